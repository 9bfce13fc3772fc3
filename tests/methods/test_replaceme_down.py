"""estimator="lstsq_down": the bridged layer's down projection refitted on its own inputs, against naive references."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import (
    compress,
    decoder_layers,
    logits,
    mlp_parts,
    naive_fit_rows,
    residual_streams,
    sample_ids,
    tiny_config,
)
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.ops.linear_map import (
    RIDGE_GRID,
    LinearMapStatistics,
    fit_towards_prior,
    folded_map_prior,
    ridge_towards,
    solve_least_squares,
)


def _down(layer):
    """The down projection module (LLaMA-like ``mlp.down_proj``, GPT-2 ``mlp.c_proj``)."""
    return layer.mlp.down_proj if hasattr(layer.mlp, "down_proj") else layer.mlp.c_proj


@torch.no_grad()
def _naive_down_rows(model, batches, layer: int, end: int):
    """Float64 rows over every real token, from full forwards: A (the down projection's input at `layer`), Y (the
    stream entering that layer's MLP norm) and L (the stream after the first `end` layers)."""
    targets = residual_streams(model, batches, end)
    _, norm, _ = mlp_parts(decoder_layers(model)[layer])
    captured = {}
    handles = [
        _down(decoder_layers(model)[layer]).register_forward_pre_hook(lambda _m, a: captured.__setitem__("a", a[0])),
        norm.register_forward_pre_hook(lambda _m, a: captured.__setitem__("y", a[0])),
    ]
    rows = {"a": [], "y": [], "l": []}
    try:
        for batch, target in zip(batches, targets, strict=True):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            keep = batch.attention_mask.bool()
            rows["a"].append(captured["a"][keep].double())
            rows["y"].append(captured["y"][keep].double())
            rows["l"].append(target[keep].double())
    finally:
        for handle in handles:
            handle.remove()
    return (torch.cat(rows[k]) for k in ("a", "y", "l"))


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "gpt2"])  # gpt2: a down projection with a bias
def test_down_refit_is_the_naive_least_squares_of_its_inputs(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator="lstsq_down")
    quantizer = compress(model, config)
    ((start, end),) = quantizer.report["blocks"]
    (entry,) = quantizer.report["replaceme"]["maps"]
    assert entry["span"] == [start - 1, end] and entry["refitted"] == "down_projection"
    # One calibration batch: nothing is held out to choose a ridge, so this is the plain refit.
    assert entry["ridge"] == 0.0 and entry["ridge_chosen_on"] == "none held out (one calibration batch)"
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    a, y, target = _naive_down_rows(original, batches, start - 1, end)
    has_bias = _down(decoder_layers(original)[start - 1]).bias is not None
    assert has_bias == (factory == "gpt2")
    features = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1) if has_bias else a
    solution = torch.linalg.lstsq(features, target - y).solution  # (in [+1], hidden), rows are tokens
    assert entry["tokens"] == a.shape[0]

    _, _, weight_after = mlp_parts(decoder_layers(model)[start - 1])
    torch.testing.assert_close(weight_after().double(), solution[: a.shape[1]].T, atol=2e-5, rtol=1e-4)
    if has_bias:
        torch.testing.assert_close(
            _down(decoder_layers(model)[start - 1]).bias.double(), solution[-1], atol=2e-5, rtol=1e-4
        )
    else:
        assert _down(decoder_layers(model)[start - 1]).bias is None  # the architecture is unchanged
    assert len(decoder_layers(model)) == len(decoder_layers(original)) - 2


def test_down_refit_fits_the_calibration_at_least_as_well_as_replacemes_map():
    """T's fold Tᵀ W_down is one of the down projections the refit chooses among: on the calibration rows the refit's
    squared error is never larger (and here strictly smaller, so the test can tell the two apart)."""
    model = tiny_models.FACTORIES["llama_gqa"]()
    original = copy.deepcopy(model)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator="lstsq_down")
    quantizer = compress(model, config)
    ((start, end),) = quantizer.report["blocks"]
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    a, y, target = _naive_down_rows(original, batches, start - 1, end)
    m, _, _ = naive_fit_rows(original, batches, start - 1, end)
    transform = torch.linalg.lstsq(m, target - y).solution
    _, _, weight_after = mlp_parts(decoder_layers(model)[start - 1])
    refit_error = float(((a @ weight_after().detach().double().T - (target - y)) ** 2).sum())
    replaceme_error = float(((m @ transform - (target - y)) ** 2).sum())
    assert refit_error < replaceme_error * (1 - 1e-3)


def test_statistics_with_an_intercept_and_another_output_width_equal_lstsq_and_ignore_padding():
    torch.manual_seed(0)
    inputs = torch.randn(3, 7, 5, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1e3], dtype=torch.float64)
    targets = torch.randn(3, 7, 4, dtype=torch.float64)
    mask = torch.ones(3, 7)
    mask[1, 4:] = 0
    inputs[1, 4:] = 1e6  # padding: must not reach the statistics
    stats = LinearMapStatistics(5, out_dim=4, intercept=True)
    stats.update(inputs[:2], targets[:2], mask[:2])
    stats.update(inputs[2:], targets[2:], mask[2:])
    solution, _ = solve_least_squares(stats)
    keep = mask.bool()
    rows = torch.cat([inputs[keep], torch.ones(int(keep.sum()), 1, dtype=torch.float64)], dim=1)
    expected = torch.linalg.lstsq(rows, targets[keep]).solution
    assert solution.shape == (6, 4) and stats.count == int(keep.sum())
    # The normal equations square the condition number (about 1e4 here with the intercept): 1e8 x eps(float64).
    torch.testing.assert_close(solution, expected, atol=1e-6, rtol=1e-6)
    assert stats.target_norm == pytest.approx(float((targets[keep] ** 2).sum()), rel=1e-12)
    with pytest.raises(ValueError, match="square map only"):
        LinearMapStatistics(5, with_gain=True, intercept=True)


def test_statistics_in_chunks_equal_one_pass(monkeypatch):
    """The float64 conversion runs a chunk of rows at a time; the sums are those of one pass (up to rounding)."""
    from optimum_flatten.ops import linear_map

    torch.manual_seed(1)
    inputs, targets = torch.randn(2, 50, 6), torch.randn(2, 50, 6)
    whole = LinearMapStatistics(6)
    whole.update(inputs, targets)
    monkeypatch.setattr(linear_map, "UPDATE_CHUNK_ROWS", 7)
    chunked = LinearMapStatistics(6)
    chunked.update(inputs, targets)
    assert chunked.count == whole.count == 100
    torch.testing.assert_close(chunked.gram, whole.gram, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(chunked.cross, whole.cross, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("method", ["shortgpt", "flattengpt"])
def test_down_refit_as_linear_replacement_reloads_with_plain_transformers(method, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["llama_gqa"]()
    with_map = copy.deepcopy(model)
    quantizer = compress(model, tiny_config(method, num_layers_to_remove=2, linear_replacement="lstsq_down"))
    compress(with_map, tiny_config(method, num_layers_to_remove=2, linear_replacement="lstsq"))
    entries = quantizer.report["linear_replacement"]["maps"]
    assert entries and all(e["refitted"] == "down_projection" for e in entries)
    ids = sample_ids(batch=2, length=16, seed=7)
    assert not torch.allclose(logits(model, ids), logits(with_map, ids), atol=1e-4)  # not ReplaceMe's T

    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


def test_an_unknown_estimator_is_refused_with_the_nearest_name():
    with pytest.raises(ValueError, match=r"unknown linear-replacement estimator 'lstsq_dwn'.*lstsq_down"):
        tiny_config("replaceme", estimator="lstsq_dwn")


def _rows(seed: int, tokens: int, width: int, out: int, noise: float = 1.0):
    """Tokens of a noisy linear map; the map is the same for every seed (only the tokens and the noise differ)."""
    truth = torch.randn(width, out, generator=torch.Generator().manual_seed(100), dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    return a, a @ truth + noise * torch.randn(tokens, out, generator=generator, dtype=torch.float64)


def _stats(a, r):
    stats = LinearMapStatistics(a.shape[1], out_dim=r.shape[1])
    stats.update(a, r)
    return stats


@pytest.mark.parametrize("ridge", [0.0, 0.05, 2.0, float("inf")])
def test_ridge_towards_a_prior_is_the_naive_stacked_least_squares(ridge):
    """min ‖A W − R‖² + λ s ‖W − P‖² is the least squares of A stacked on √(λ s) I against R stacked on √(λ s) P."""
    a, r = _rows(0, 40, 6, 3)
    prior = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    stats = _stats(a, r)
    solution, _ = ridge_towards(stats.gram, stats.cross, prior, ridge)
    if ridge == float("inf"):
        torch.testing.assert_close(solution, prior, atol=0, rtol=0)
        return
    root = (ridge * float((a * a).sum(0).mean())) ** 0.5
    stacked = torch.cat([a, root * torch.eye(6, dtype=torch.float64)])
    expected = torch.linalg.lstsq(stacked, torch.cat([r, root * prior])).solution
    torch.testing.assert_close(solution, expected, atol=1e-10, rtol=1e-10)


def test_the_folded_prior_is_replacemes_map_on_the_layers_outputs():
    a, r = _rows(1, 60, 8, 4)
    lifted = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    transform = torch.linalg.lstsq(a @ lifted, r).solution  # T on M = A lifted, as ReplaceMe fits it
    torch.testing.assert_close(folded_map_prior(lifted)(_stats(a, r)), lifted @ transform, atol=1e-10, rtol=1e-10)


def test_the_ridge_is_chosen_by_the_naive_held_out_error_and_refitted_on_all():
    a, r = _rows(3, 20, 12, 4, noise=3.0)  # few, noisy tokens: the plain refit over-fits, a ridge predicts better
    held_a, held_r = _rows(4, 30, 12, 4, noise=3.0)
    prior = torch.zeros(12, 4, dtype=torch.float64)
    fit, held = _stats(a, r), _stats(held_a, held_r)
    solution, choice = fit_towards_prior(fit, held, lambda _s: prior)
    naive = {}
    for ridge in RIDGE_GRID:
        if ridge == float("inf"):
            w = prior
        else:
            root = (ridge * float((a * a).sum(0).mean())) ** 0.5
            stacked = torch.cat([a, root * torch.eye(12, dtype=torch.float64)])
            w = torch.linalg.lstsq(stacked, torch.cat([r, root * prior])).solution
        naive[ridge] = float(((held_a @ w - held_r) ** 2).sum() / (held_r**2).sum())
    assert choice.held_out_errors == pytest.approx(naive, rel=1e-8)
    assert choice.ridge == min(naive, key=naive.get) and 0 < choice.ridge < float("inf")
    both_a, both_r = torch.cat([a, held_a]), torch.cat([r, held_r])
    root = (choice.ridge * float((both_a * both_a).sum(0).mean())) ** 0.5
    stacked = torch.cat([both_a, root * torch.eye(12, dtype=torch.float64)])
    expected = torch.linalg.lstsq(stacked, torch.cat([both_r, root * prior])).solution
    torch.testing.assert_close(solution, expected, atol=1e-10, rtol=1e-10)


def test_the_method_chooses_the_ridge_on_its_last_batch_and_an_infinite_ridge_is_replaceme():
    model = tiny_models.FACTORIES["llama_gqa"]()
    original, as_replaceme, replaceme = (copy.deepcopy(model) for _ in range(3))
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator="lstsq_down", batch_size=4)
    quantizer = compress(model, config)
    (entry,) = quantizer.report["replaceme"]["maps"]
    ((start, end),) = quantizer.report["blocks"]
    assert entry["ridge_chosen_on"] == "the last calibration batch"
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    assert len(batches) == 2
    a, y, target = _naive_down_rows(original, batches[:1], start - 1, end)
    held_a, held_y, held_target = _naive_down_rows(original, batches[1:], start - 1, end)
    _, _, down = mlp_parts(decoder_layers(original)[start - 1])
    lifted = down().double().T
    naive = {}
    for ridge in RIDGE_GRID:
        transform = torch.linalg.lstsq(a @ lifted, target - y).solution
        prior = lifted @ transform
        if ridge == float("inf"):
            w = prior
        else:
            root = (ridge * float((a * a).sum(0).mean())) ** 0.5
            stacked = torch.cat([a, root * torch.eye(a.shape[1], dtype=torch.float64)])
            w = torch.linalg.lstsq(stacked, torch.cat([target - y, root * prior])).solution
        naive[ridge] = float(((held_a @ w - (held_target - held_y)) ** 2).sum() / ((held_target - held_y) ** 2).sum())
    chosen = {float(k): v for k, v in entry["held_out_errors"].items()}
    assert chosen == pytest.approx(naive, rel=1e-6, abs=1e-9)
    assert entry["ridge"] == min(naive, key=naive.get)

    compress(
        as_replaceme,
        tiny_config(
            "replaceme",
            num_layers_to_remove=2,
            tokens="all",
            estimator="lstsq_down",
            down_ridge=float("inf"),
            batch_size=4,
        ),
    )
    compress(replaceme, tiny_config("replaceme", num_layers_to_remove=2, tokens="all", batch_size=4))
    _, _, infinite = mlp_parts(decoder_layers(as_replaceme)[start - 1])
    _, _, folded = mlp_parts(decoder_layers(replaceme)[start - 1])
    torch.testing.assert_close(infinite(), folded(), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="down_ridge must be None"):
        tiny_config("replaceme", estimator="lstsq_down", down_ridge=-1.0)


def test_auto_takes_the_down_refit_as_an_option_and_as_a_correction():
    config = tiny_config(
        "auto", num_layers_to_remove=2, candidates="replaceme:estimator=lstsq_down shortgpt+lstsq_down"
    )
    assert config.method_config.candidates.split() == ["replaceme:estimator=lstsq_down", "shortgpt+lstsq_down"]
    with pytest.raises(ValueError, match="lstsq_down"):
        tiny_config("auto", num_layers_to_remove=2, candidates="shortgpt+lstsq_dwn")
