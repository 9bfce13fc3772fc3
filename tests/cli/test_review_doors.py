"""Doors a review of `evaluate`, `demo`, `optimum-cli flatten` and the dataset forms found open: each refusal comes
before any weights load and names the flag, the bundled models' cache is never an output, the evaluation says the
device and dtype it ran in, and a folder `datasets` saved reads as the dataset it holds."""

from __future__ import annotations

import json
import subprocess

import pytest

import tiny_models
from optimum_flatten.cli.main import build_parser, main, unrecognized
from optimum_flatten.evaluation.perplexity import perplexity, tokenize_corpus


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model for a measurement fails the test: what is refused must be refused before."""
    import optimum_flatten.evaluation.compare as compare

    monkeypatch.setattr(compare, "_load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))


def _evaluate(model, text, *extra) -> list[str]:
    return ["evaluate", str(model), "--dataset", str(text), "--no-speed", "--seqlen", "16", *extra]


def test_a_tokenizer_giving_ids_the_model_has_no_embedding_for_is_refused_before_loading(
    llama_on_disk, tmp_path, capsys, no_loading
):
    _, text = llama_on_disk
    model = tiny_models.tiny_llama_gqa()
    model.resize_token_embeddings(8)  # the tokenizer gives the text ids far past 8
    folder = tmp_path / "small"
    model.save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    assert main(_evaluate(folder, text)) == 2
    message = _error(capsys)
    assert "8 token embeddings" in message and "is not this model's" in message


def test_a_checkpoint_without_a_tokenizer_is_refused_naming_it(llama_on_disk, tmp_path, capsys, no_loading):
    _, text = llama_on_disk
    folder = tmp_path / "bare"
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    assert main(_evaluate(folder, text)) == 2
    message = _error(capsys)
    assert str(folder) in message and "has no tokenizer that loads" in message


@pytest.mark.parametrize(
    "options, message",
    [
        (["--seqlen", "1"], "--seqlen must be at least 2"),
        (["--seqlen", "0"], "--seqlen must be at least 2"),
        (["--stride", "17"], r"--stride must be in 1..--seqlen \(16\)"),
        (["--lm-eval-limit", "3"], "--lm-eval-limit applies with --lm-eval-tasks"),
        (["--allow-different-tokenizers"], "--allow-different-tokenizers applies with --baseline"),
    ],
)
def test_evaluate_options_are_refused_by_their_flag_before_anything_loads(
    llama_on_disk, capsys, no_loading, monkeypatch, options, message
):
    import optimum_flatten.cli.evaluate as evaluate

    monkeypatch.setattr(evaluate, "check_models", lambda *a, **k: pytest.fail("a config was read before the refusal"))
    dense, text = llama_on_disk
    assert main([*_evaluate(dense, text), *options]) == 2
    assert pytest.importorskip("re").search(message, _error(capsys))


def test_max_tokens_none_scores_the_whole_text_and_the_json_says_device_and_dtype(llama_on_disk, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense, text = llama_on_disk
    out = tmp_path / "eval.json"
    assert main([*_evaluate(dense, text, "--max-tokens", "none", "--stride", "none", "--json", str(out))]) == 0
    assert "every model loaded in float32 on cpu" in capsys.readouterr().out
    measured = json.loads(out.read_text())
    assert (measured["device"], measured["dtype"]) == ("cpu", "float32")
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    stream = tokenize_corpus(AutoTokenizer.from_pretrained(dense), [text.read_text()])
    whole = perplexity(model, stream, seqlen=16, max_tokens=None)
    assert measured["models"][0]["perplexity"] == pytest.approx(whole.perplexity, rel=1e-6)
    assert whole.scored_tokens == stream.numel() - whole.windows  # every window but its first token: the whole text
    assert f"{whole.scored_tokens} scored tokens" in measured["models"][0]["protocol"]


def test_a_tokenizer_difference_names_each_sides_id():
    from optimum_flatten.evaluation.tokenization import TokenizationDifference

    said = TokenizationDifference(0, "The", "The", 312, 290).describe()
    assert said == "token 0 is 'The' (id 312) for the baseline and 'The' (id 290) for the model"
    assert "the end of its stream for the model" in TokenizationDifference(4, "a", None, 7, None).describe()


def test_the_figure_of_a_bits_per_byte_comparison_shows_bits_per_byte(tmp_path, monkeypatch):
    import matplotlib.axes

    from optimum_flatten.evaluation.compare import plot_comparison

    drawn = {}
    original = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes, "bar", lambda self, x, h, **k: drawn.setdefault("heights", list(h)) and original
    )
    entries = [
        {"path": "a", "layers": 4, "perplexity": 10.0, "bits_per_byte": 1.25, "flatten_report": None},
        {"path": "b", "layers": 2, "perplexity": 30.0, "bits_per_byte": 1.5, "flatten_report": None},
    ]
    plot_comparison(entries, tmp_path / "f.png")
    assert drawn["heights"] == [1.25, 1.5]


def test_a_folder_datasets_saved_reads_as_its_dataset_for_calibration_and_healing(tmp_path):
    datasets = pytest.importorskip("datasets")
    from optimum_flatten.calibration.data import load_texts
    from optimum_flatten.recovery import load_recovery_texts

    datasets.Dataset.from_dict({"text": ["one", "", "two"]}).save_to_disk(str(tmp_path / "plain"))
    assert load_texts(str(tmp_path / "plain")) == ["one", "two"]
    alpaca = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"instruction": ["hi"], "output": ["ho"]})})
    alpaca.save_to_disk(str(tmp_path / "alpaca"))
    texts, kind = load_recovery_texts(str(tmp_path / "alpaca"))
    assert kind == "alpaca" and "### Instruction:\nhi" in texts[0]


def test_a_json_object_without_records_or_the_text_field_is_named(tmp_path):
    from optimum_flatten.calibration.data import load_texts
    from optimum_flatten.utils.errors import CalibrationDataError

    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": ["a"], "meta": 1}))
    with pytest.raises(CalibrationDataError, match=r"keys \['meta', 'rows'\], none of them 'data'"):
        load_texts(str(path))


@pytest.fixture
def bundled_cache(tmp_path, monkeypatch):
    """The bundled models' cache in a folder of the test's, holding a converted SmolLM2 of 30 layers (its config)."""
    from transformers import LlamaConfig

    from optimum_flatten import bundled

    monkeypatch.setenv("OPTIMUM_FLATTEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / bundled.BUNDLED_MODELS["smollm2"].name
    LlamaConfig(num_hidden_layers=30).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    "options, message",
    [
        (["--speed-rounds", "1"], "--speed-rounds must be at least 2"),
        (["--method", "ffn_merge"], "ffn_merge keeps every layer"),
        (["--num-layers-to-remove", "30"], r"must be in 1..29 \(SmolLM2-135M has 30 layers\)"),
        (["--eval-seqlen", "1"], "--eval-seqlen must be at least 2"),
        (["--eval-tokens", "0"], "--eval-tokens must be at least 2"),
    ],
)
def test_demo_options_are_refused_before_the_model_loads(bundled_cache, monkeypatch, capsys, options, message):
    from optimum_flatten import bundled

    monkeypatch.setattr(bundled, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    assert main(["demo", *options]) == 2
    assert pytest.importorskip("re").search(message, _error(capsys))


@pytest.mark.parametrize("verb", ["demo", "compress"])
def test_the_bundled_models_cache_is_never_an_output(bundled_cache, llama_on_disk, monkeypatch, capsys, verb):
    import optimum_flatten.cli.main as cli
    from optimum_flatten import bundled

    monkeypatch.setattr(bundled, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    before = sorted(p.name for p in bundled_cache.iterdir())
    argv = {
        "demo": ["demo"],
        "compress": ["compress", "smollm2", "--num-layers-to-remove", "2", "--dataset", str(llama_on_disk[1])],
    }[verb]
    assert main([*argv, "--output", str(bundled_cache), "--overwrite"]) == 2
    assert "a bundled model's cached checkpoint" in _error(capsys)
    assert sorted(p.name for p in bundled_cache.iterdir()) == before


def test_a_data_file_that_does_not_exist_is_refused_before_the_model_loads(
    llama_on_disk, tmp_path, monkeypatch, capsys
):
    import optimum_flatten.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    dense, _ = llama_on_disk
    argv = ["compress", str(dense), "--num-layers-to-remove", "2", "--dataset", "nofile.jsonl"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 2
    assert "dataset path 'nofile.jsonl' does not exist" in _error(capsys)


def test_an_unknown_flag_is_not_pointed_at_a_hidden_refused_spelling():
    parser = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    compress = parser.choices["compress"]
    assert any(a.option_strings == ["--threshold"] for a in compress._actions)  # hidden, refused when given
    assert "'--threshold'" not in unrecognized(compress, ["--threshol"])


def test_optimum_cli_hands_verbose_on_and_its_help_names_the_verbs(llama_on_disk):
    listed = subprocess.run(["optimum-cli", "flatten", "-h"], capture_output=True, text=True)
    said = " ".join(listed.stdout.split())
    assert listed.returncode == 0 and "estimate, layer- collapse, demo" in said and "VERB --help" in said
    dense, _ = llama_on_disk
    argv = ["optimum-cli", "flatten", "-v", "estimate", str(dense), "--num-layers-to-remove", "1"]
    verbose = subprocess.run(argv, capture_output=True, text=True)  # optimum's parser took -v for its own before
    assert verbose.returncode == 0, verbose.stderr
    assert "phase" in verbose.stdout


@pytest.mark.parametrize("verb", ["estimate", "compress"])
def test_a_config_field_of_the_wrong_type_is_one_line(tmp_path, capsys, verb):
    folder = tmp_path / "bad"
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = "abc"
    (folder / "config.json").write_text(json.dumps(config))
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(8)))
    argv = {
        "estimate": ["estimate", str(folder), "--method", "shortgpt", "--num-layers-to-remove", "1"],
        "compress": ["compress", str(folder), "--method", "shortgpt", "--num-layers-to-remove", "1", "--dataset",
                     str(text), "--output", str(tmp_path / "out")],
    }[verb]  # fmt: skip
    assert main(argv) == 2
    assert "intermediate_size" in _error(capsys)


def test_a_flag_another_verb_spells_longer_is_pointed_at_this_verbs_own():
    parser = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    assert "--heal-tokens: did you mean '--heal'?" in unrecognized(parser.choices["estimate"], ["--heal-tokens", "9"])


def test_a_demo_compression_refused_by_its_method_says_where_the_options_are(bundled_cache, monkeypatch, capsys):
    """The demo takes no method options, so advice naming them (LaCo's threshold) points at `compress`."""
    from optimum_flatten import bundled
    from optimum_flatten.quantizer import FlattenQuantizer

    tokenizer = tiny_models.tiny_hf_tokenizer()
    monkeypatch.setattr(bundled, "load_smollm2", lambda *a, **k: (tiny_models.tiny_llama_gqa(), tokenizer))
    monkeypatch.setattr(bundled, "load_corpus", lambda *a, **k: tiny_models.sample_texts(20))

    def refused(self, model, tokenizer):
        raise ValueError("laco could not remove 2 layers at threshold=0.65; lower threshold")

    monkeypatch.setattr(FlattenQuantizer, "compress", refused)
    argv = ["demo", "--method", "laco", "--num-layers-to-remove", "2", "--nsamples", "2", "--seqlen", "16",
            "--eval-seqlen", "16", "--eval-tokens", "64"]  # fmt: skip
    assert main(argv) == 2
    message = _error(capsys)
    assert "lower threshold" in message and "`optimum-flatten compress smollm2 --method laco ...`" in message
