"""A checkpoint whose tokenizer is remote code (Baichuan-2's ``tokenization_baichuan.py``), through the doors users
take: the command line, compress-on-load and `FlattenQuantizer.from_pretrained`. Untrusted, it is refused in one line
that names the cause before any weight is read or changed; trusted, it calibrates."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

import tiny_models
from common import one_error_line
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.cli.main import main
from optimum_flatten.integration import FlattenHfQuantizer
from optimum_flatten.utils.errors import ModelSourceError


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    tiny_models.remote_code_tokenizer(folder)
    (tmp_path / "texts.txt").write_text("\n".join(tiny_models.sample_texts()))
    return folder


def _arguments(folder, out):
    texts = folder.parent / "texts.txt"
    options = ["--num-layers-to-remove", "2", "--dataset", str(texts), "--nsamples", "8", "--seqlen", "24"]
    return ["compress", str(folder), "--method", "shortgpt", *options, "--output", str(out), "--no-progress"]


def test_the_cli_names_the_untrusted_tokenizer_and_writes_nothing(checkpoint, capsys):
    out = checkpoint.parent / "out"
    assert main(_arguments(checkpoint, out)) != 0
    line = one_error_line(capsys)
    assert "remote code" in line and "--trust-remote-code" in line, line
    assert not out.exists()
    assert main([*_arguments(checkpoint, out), "--trust-remote-code"]) == 0
    assert (out / "tokenization_tiny.py").is_file()


def _config(**options):
    return FlattenConfig(
        method="shortgpt", num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, **options
    )


def test_compress_on_load_refuses_before_the_weights_are_read(checkpoint, monkeypatch):
    """from_pretrained keeps its trust_remote_code to itself: the refusal says to pass the tokenizer, and comes from
    the step before the weights load."""

    def weights_loaded(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(FlattenHfQuantizer, "_process_model_after_weight_loading", weights_loaded)
    with pytest.raises(ModelSourceError, match=r"FlattenConfig\(tokenizer=AutoTokenizer.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, quantization_config=_config())


def test_compress_on_load_calibrates_with_the_tokenizer_passed(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_config(tokenizer=tokenizer))
    assert model.config.num_hidden_layers == 4


def test_from_pretrained_passes_trust_remote_code_to_the_tokenizer(checkpoint):
    quantizer = FlattenQuantizer.from_pretrained(str(checkpoint), trust_remote_code=True)
    assert type(quantizer.tokenizer).__name__ == "TinyRemoteTokenizer"
    with pytest.raises(ModelSourceError, match="remote code, which was not trusted"):
        FlattenQuantizer.from_pretrained(str(checkpoint))
