"""`optimum-flatten estimate --own-text` against what ``compress --own-text`` samples and holds.

The model writes its share of the calibration rows before anything is compressed and before a heal's dense copy is
taken; the estimate adds that phase first: one sampling batch's KV caches at the rows' full length and one step's
logits, at the batch the CPU sampler takes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import tiny_models
from common import write_llama2_7b_config
from optimum_flatten.cli.main import main
from optimum_flatten.estimate import meta_model
from optimum_flatten.estimate.own_text import OWN_TEXT_PHASE
from optimum_flatten.recovery.footprint import weight_bytes
from optimum_flatten.recovery.teacher_text import CPU_BATCH_SIZE, MAX_BATCH_SIZE

ESTIMATE = ["--method", "shortgpt", "--num-layers-to-remove", "1", "--json"]
NSAMPLES, SEQLEN = 8, 32


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def _estimate(capsys, folder, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["estimate", str(folder), *ESTIMATE, "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), *argv])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return json.loads(printed.out)


def _naive_row_bytes(config: Any, length: int, element: int = 4) -> tuple[int, int]:
    """One row's KV cache (keys and values of every layer) at `length` tokens, and its float32 logits three times
    over (scores, processed scores, softmax), written out from the config."""
    head_dim = config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * length * element
    return cache, 3 * 4 * config.vocab_size


def test_the_sampling_phase_comes_first_and_holds_one_batch_of_caches_and_logits(dense, capsys):
    plain = _estimate(capsys, dense)
    own = _estimate(capsys, dense, "--own-text", "0.5")
    phase = own["phases"][0]
    assert phase["name"] == OWN_TEXT_PHASE
    assert own["phases"][1:] == plain["phases"]  # the compression's phases are what they were
    rows = NSAMPLES // 2
    cache, logits = _naive_row_bytes(tiny_models.tiny_llama_gqa().config, SEQLEN + 1)
    assert [t["bytes"] for t in phase["terms"]] == [rows * cache, rows * logits]  # all 4 rows in one batch
    assert any(f"samples {rows} of the {NSAMPLES} calibration rows" in note for note in own["notes"])


@pytest.mark.parametrize(
    ("gpu", "cap"), [([], CPU_BATCH_SIZE), (["--device", "h100"], MAX_BATCH_SIZE)], ids=["host-memory", "an-h100"]
)
def test_the_batch_is_what_fits_half_the_free_memory_at_most_the_samplers_cap(tmp_path, capsys, monkeypatch, gpu, cap):
    """LLaMA-2-7B in bfloat16 at 128 x 2048, half of them its own: a row's cache is 1 GiB, so with 60 GiB free the
    sampler takes 23 rows ((60 - 12.55) / 2); with 400 GiB free, every one of the 64 rows on a CPU (its cap is 64)
    and on a GPU (its cap is 256)."""
    write_llama2_7b_config(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = meta_model(str(tmp_path), "bfloat16").config
    cache, logits = _naive_row_bytes(config, 2049, element=2)
    weights = weight_bytes(meta_model(str(tmp_path), "bfloat16"))
    for free_gib in (60, 400):
        capsys.readouterr()
        argv = ["--method", "replaceme", "--num-layers-to-remove", "8", "--dtype", "bfloat16", "--json"]
        argv += ["--own-text", "0.5", "--free-memory-gib", str(free_gib), *gpu]
        assert main(["estimate", str(tmp_path), *argv]) == 0
        phase = json.loads(capsys.readouterr().out)["phases"][0]
        fits = int(0.5 * (free_gib * 2**30 - weights)) // (cache + logits)
        expected = min(64, cap, fits)
        assert phase["terms"][0]["bytes"] == expected * cache
        assert expected == (23 if free_gib == 60 else 64)


def test_the_cache_term_is_the_cache_generate_holds_at_the_rows_length(dense):
    """The KV term against the cache transformers' ``generate`` really holds after sampling a row: it caches every
    token but the last one sampled, so the term (the row's full length) is at most one token over."""
    model = tiny_models.tiny_llama_gqa().eval()
    start = torch.tensor([[model.config.bos_token_id or 1]] * 2)
    out = model.generate(start, max_new_tokens=SEQLEN, do_sample=True, return_dict_in_generate=True,
                         pad_token_id=0, min_new_tokens=SEQLEN)  # fmt: skip
    held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    cache, _ = _naive_row_bytes(model.config, SEQLEN + 1)
    per_token = cache // (SEQLEN + 1)
    assert 2 * cache - 2 * per_token <= held <= 2 * cache


def test_the_run_samples_at_the_batch_the_estimate_counts(dense, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(60)))
    estimate = _estimate(capsys, dense, "--own-text", "0.5")
    code = main(["compress", str(dense), *ESTIMATE[:-1], "--dataset", str(text), "--nsamples", str(NSAMPLES),
                 "--seqlen", str(SEQLEN), "--own-text", "0.5", "--output", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "out" / "flatten_report.json").read_text())["calibration"]["own_text"]
    batch = min(record["batch_size"], record["rows"])  # the sampler's batch, of the rows there are
    assert estimate["phases"][0]["terms"][0]["name"] == f"KV cache ({batch} rows x {SEQLEN + 1} tokens)"


def test_with_a_heal_the_dense_copy_is_not_held_while_the_rows_are_sampled(dense, capsys):
    healed = _estimate(capsys, dense, "--own-text", "0.5", "--heal", "--heal-seqlen", str(SEQLEN))
    sampling, *compression = healed["phases"]
    assert sampling["name"] == OWN_TEXT_PHASE
    assert not any("teacher" in t["name"] for t in sampling["terms"])
    assert all(any("teacher" in t["name"] for t in phase["terms"]) for phase in compression)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--own-text", "1.0"], "own_text is the share of calibration sequences"),
        (["--own-text", "-0.5"], "in [0, 1)"),
        (["--own-text", "0.5", "--device", "h100"], "estimate --own-text with --device h100 needs --free-memory-gib"),
    ],
)
def test_a_bad_request_is_refused_in_one_line(dense, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine with no GPU to read
    capsys.readouterr()
    assert main(["estimate", str(dense), *ESTIMATE, *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_model_that_writes_no_text_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "bert"
    tiny_models.tiny_bert().save_pretrained(folder)
    capsys.readouterr()
    assert main(["estimate", str(folder), *ESTIMATE, "--own-text", "0.5"]) != 0
    err = capsys.readouterr().err.strip()
    assert "needs a model that writes text" in err and len(err.splitlines()) == 1


def test_an_encoder_decoder_model_is_refused_in_one_line(tmp_path, capsys):
    """Its decoder writes from a source text; the cache it would hold has cross-attention, which the term does not
    count, and `compress --own-text` refuses it too."""
    folder = tmp_path / "marian"
    tiny_models.tiny_marian().save_pretrained(folder)
    capsys.readouterr()
    assert main(["estimate", str(folder), *ESTIMATE, "--stack", "decoder", "--own-text", "0.5"]) != 0
    err = capsys.readouterr().err.strip()
    assert "is an encoder-decoder model" in err and len(err.splitlines()) == 1


def test_without_a_device_named_the_rows_are_sampled_in_host_memory_where_compress_loads_the_model(
    dense, capsys, monkeypatch
):
    """On a machine with a GPU, `optimum-flatten compress` still loads the model in host memory and samples there,
    at most 64 rows a batch: the estimate sized the batch for the GPU (up to 256 rows)."""
    from optimum_flatten.estimate import own_text

    monkeypatch.setattr(own_text, "host_training_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(own_text, "available_bytes", lambda device: {"cpu": 2**40}[str(device)])
    result = _estimate(capsys, dense, "--nsamples", "400", "--own-text", "0.5")
    assert result["phases"][0]["terms"][0]["name"] == f"KV cache ({CPU_BATCH_SIZE} rows x {SEQLEN + 1} tokens)"
    assert any("free on cpu with the model loaded" in note for note in result["notes"])
