"""`optimum-flatten evaluate` refuses what the configs, the tokenizer and the text can tell before any model loads
(an encoder, vocabularies that cannot be compared, positions the fixed-length measurements run past, a text too short
for the greedy prompts, a figure format matplotlib cannot write, a single speed round), reads the text column it is
given, and writes its JSON whole, before the figure."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import main
from optimum_flatten.evaluation.fidelity import fidelity
from optimum_flatten.evaluation.perplexity import perplexity
from optimum_flatten.utils.files import TEMPORARY_PREFIX


@pytest.fixture
def on_disk(llama_on_disk):
    return llama_on_disk


@pytest.fixture
def no_loading(monkeypatch):
    """Makes loading a model fail the test: what is refused must be refused before."""
    import optimum_flatten.evaluation.compare as compare

    monkeypatch.setattr(compare, "_load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))


def _save(model, folder):
    model.save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("build", [tiny_models.tiny_bert, tiny_models.tiny_marian], ids=["encoder", "encoder-decoder"])
def test_a_model_that_is_not_a_causal_lm_is_refused_before_it_loads(build, on_disk, tmp_path, capsys, no_loading):
    _, text = on_disk
    model = _save(build(), tmp_path / "model")
    assert main(["evaluate", str(model), "--dataset", str(text), "--no-speed"]) == 2
    assert "evaluate scores causal language models" in one_error_line(capsys)


def test_models_over_different_vocabularies_are_not_compared_token_by_token(on_disk, tmp_path, capsys, no_loading):
    dense, text = on_disk
    model = tiny_models.tiny_llama_gqa()
    model.resize_token_embeddings(model.config.vocab_size + 32)
    resized = _save(model, tmp_path / "resized")
    argv = ["evaluate", str(resized), "--baseline", str(dense), "--dataset", str(text), "--no-speed"]
    assert main(argv) == 2 and "--no-fidelity --no-generation" in one_error_line(capsys)


def test_positions_the_fixed_length_measurements_run_past_are_refused(tmp_path, on_disk, capsys, no_loading):
    _, text = on_disk
    gpt2 = _save(tiny_models.tiny_gpt2(n_positions=64), tmp_path / "gpt2")
    common = ["evaluate", str(gpt2), "--dataset", str(text), "--seqlen", "32"]
    assert main(common) == 2 and "--no-speed" in one_error_line(capsys)  # decode timing: 64 + 32 positions
    assert main([*common, "--baseline", str(gpt2), "--no-speed"]) == 2 and "--no-generation" in one_error_line(capsys)


def test_a_text_too_short_for_the_greedy_prompts_is_refused_before_measuring(on_disk, tmp_path, capsys, no_loading):
    dense, _ = on_disk
    short = tmp_path / "short.txt"
    short.write_text("a few words, far fewer than sixteen prompts of sixty-four tokens")
    argv = ["evaluate", str(dense), "--baseline", str(dense), "--dataset", str(short), "--no-speed", "--no-fidelity"]
    assert main(argv) == 2 and "--no-generation" in one_error_line(capsys)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--plot", "{folder}/figure.txt"], "matplotlib writes"),
        (["--speed-rounds", "1"], "at least 2"),
        (["--lm-eval-tasks", "local_text_perplexity", "--lm-eval-limit", "0"], "at least one document"),
    ],
    ids=["figure format", "one speed round", "lm-eval limit"],
)
def test_options_that_would_fail_at_the_end_are_refused_first(on_disk, tmp_path, capsys, monkeypatch, options, message):
    import optimum_flatten.cli.evaluate as evaluate

    if "--lm-eval-tasks" in options:
        pytest.importorskip("lm_eval")
    monkeypatch.setattr(evaluate, "measure", lambda args: pytest.fail("measured before refusing"))
    dense, text = on_disk
    filled = [o.format(folder=tmp_path) for o in options]
    assert main(["evaluate", str(dense), "--dataset", str(text), *filled]) == 2 and message in one_error_line(capsys)


def test_the_text_column_is_read_and_the_json_is_written_whole_before_the_figure(on_disk, tmp_path, monkeypatch):
    dense, _ = on_disk
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"content": t}) + "\n" for t in tiny_models.sample_texts(60)))
    out, figure = tmp_path / "eval.json", tmp_path / "figure.png"
    out.write_text('{"an earlier": "run"}')
    import optimum_flatten.evaluation.compare as compare

    def failing(entries, path):
        raise OSError("the disk is full")

    monkeypatch.setattr(compare, "plot_comparison", failing)
    argv = ["evaluate", str(dense), "--dataset", str(rows), "--text-column", "content", "--no-speed", "--seqlen", "32",
            "--max-tokens", "256", "--json", str(out), "--plot", str(figure)]  # fmt: skip
    assert main(argv) == 2  # the figure failed ...
    measured = json.loads(out.read_text())  # ... after the numbers were written whole, over the earlier run's
    assert measured["models"][0]["perplexity"] > 1 and measured["models"][0]["protocol"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TEMPORARY_PREFIX)] == []


def test_folders_of_the_same_name_get_bars_of_their_own():
    from optimum_flatten.evaluation.compare import bar_names

    assert bar_names([{"path": "runs/a/dense"}, {"path": "runs/b/small"}]) == ["dense", "small"]
    assert bar_names([{"path": "runs/a/dense"}, {"path": "runs/b/dense"}]) == ["runs/a/dense", "runs/b/dense"]


def test_a_model_past_a_floats_range_scores_infinity_and_fidelity_refuses_an_empty_stream():
    model = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)  # logits of ~1e4: a mean NLL far past exp's range
    assert perplexity(model, torch.arange(3, 40), seqlen=16).perplexity == math.inf
    row = torch.arange(3, 40)[None]  # what tokenizer(..., return_tensors="pt").input_ids gives
    assert perplexity(tiny_models.tiny_llama_gqa(), row, seqlen=16) == perplexity(
        tiny_models.tiny_llama_gqa(), row[0], seqlen=16
    )
    dense = tiny_models.tiny_llama_gqa()
    with pytest.raises(ValueError, match="no token was scored"):
        fidelity(dense, dense, torch.arange(3, 4), seqlen=16)


def test_models_of_different_tokenizers_and_vocabularies_compare_by_bits_per_byte(on_disk, tmp_path):
    """The vocabulary check guards only the token-by-token measures: two tokenizers compared by bits per byte may
    predict over vocabularies of any size."""
    from tests.cli.test_cli_refusals import _word_tokenizer

    dense, text = on_disk
    model = tiny_models.tiny_llama_gqa()
    model.resize_token_embeddings(model.config.vocab_size + 32)
    other = tmp_path / "other"
    model.save_pretrained(other)
    _word_tokenizer().save_pretrained(other)
    argv = ["evaluate", str(dense), "--baseline", str(other), "--dataset", str(text), "--seqlen", "32", "--no-speed",
            "--max-tokens", "256", "--allow-different-tokenizers"]  # fmt: skip
    assert main(argv) == 0


def test_with_a_baseline_each_checkpoint_loads_once_and_measures_as_if_loaded_alone(on_disk, tmp_path, monkeypatch):
    """Every measurement against a baseline used to load both checkpoints again (four loads of each, minutes at
    7B); shared, each loads once, and every number equals the one its measurement gives loading its own."""
    from transformers import AutoModelForCausalLM

    import optimum_flatten.evaluation.compare as compare

    dense, text = on_disk
    model = AutoModelForCausalLM.from_pretrained(dense)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    other = _save(model, tmp_path / "other")
    loads: list[str] = []
    real = compare._load_model
    monkeypatch.setattr(compare, "_load_model", lambda path, *rest: loads.append(str(path)) or real(path, *rest))
    out = tmp_path / "eval.json"
    argv = ["evaluate", str(other), "--baseline", str(dense), "--dataset", str(text), "--seqlen", "32",
            "--max-tokens", "256", "--speed-rounds", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert sorted(loads) == sorted([str(dense), str(other)])
    measured = json.loads(out.read_text())["models"]
    window = {"seqlen": 32, "max_tokens": 256}
    for entry, path in zip(measured, (dense, other), strict=True):
        alone = compare.evaluate_checkpoint(path, str(text), speed=False, **window)
        assert entry["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-6)
        assert entry["prefill"]["tokens_per_second"] > 0 and entry["decode"]["tokens_per_second"] > 0
    fidelity_alone = compare.fidelity_to_baseline(dense, other, str(text), **window)
    assert measured[-1]["fidelity"]["kl"] == pytest.approx(fidelity_alone["kl"], rel=1e-6)
    assert measured[-1]["fidelity"]["top1_agreement"] == fidelity_alone["top1_agreement"]
    generation_alone = compare.generation_against_baseline(dense, other, str(text))
    assert measured[-1]["generation"]["token_agreement"] == generation_alone["token_agreement"]
