"""ReplaceMe's bridge where the MLP output is not one plain down projection's (issue 30).

Mixtures of experts: the map after a layer's MLP output is folded into every
expert's down projection, the shared expert's and a dense layer's own, which is exact because the MLP output is a
sum of their outputs weighted by gates that read the stream before the map.

Checked against naive references: the fold against the map applied after the MLP by a hook, in float64; the folded
weights against ``Tᵀ W`` with T from torch.linalg.lstsq on full forwards of the dense model; the down refit, which
needs one dense down projection, is refused before any weight changes.

Granite: the stream receives ``residual_multiplier`` times the MLP output, so the map is fitted on that product (a
fit on the bare output would be off by the multiplier) and folds into down_proj, with which the multiplier commutes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import (
    assert_refused_before_any_change,
    compress,
    logits,
    naive_fit_rows,
    naive_least_squares_map,
    residual_streams,
    sample_ids,
    tiny_config,
)
from optimum_flatten import get_adapter
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.recovery.selection import changed_parameter_names

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _writers(layer) -> dict[str, torch.Tensor]:
    """The tensors that write the layer's MLP output, by name (what the fold must change and nothing else)."""
    return {n: p for n, p in layer.mlp.named_parameters() if n.endswith("down_proj") or n.endswith("down_proj.weight")}


@pytest.mark.parametrize("family", MOE)
def test_the_fold_equals_the_map_applied_after_the_mixture(family):
    model = tiny_models.FACTORIES[family]()
    model.config._experts_implementation = "eager"  # the grouped kernel has no float64
    model = model.double()
    adapter = get_adapter(model)
    ids = sample_ids()
    generator = torch.Generator().manual_seed(3)
    for index, layer in enumerate(model.model.layers):  # sparse and (Qwen-MoE) dense layers alike
        hidden = model.config.hidden_size
        transform = torch.eye(hidden, dtype=torch.float64) + 0.3 * torch.randn(
            hidden, hidden, generator=generator, dtype=torch.float64
        )
        untouched = {
            n: p.clone() for n, p in layer.named_parameters() if n not in {f"mlp.{w}" for w in _writers(layer)}
        }
        handle = layer.mlp.register_forward_hook(lambda _m, _a, out, t=transform: out @ t)
        with torch.no_grad():
            expected = logits(model, ids)
        handle.remove()
        adapter.fold_after_mlp_(layer, index, transform)
        with torch.no_grad():
            torch.testing.assert_close(logits(model, ids), expected, atol=1e-10, rtol=1e-10)
        for name, parameter in layer.named_parameters():
            if name in untouched:
                assert torch.equal(parameter, untouched[name]), name  # the router and the up projections stay


@pytest.mark.parametrize("family", MOE)
def test_replaceme_folds_the_naive_least_squares_map_into_every_expert(family):
    model = tiny_models.FACTORIES[family]()
    original = copy.deepcopy(model)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all")
    result = compress(model, config)
    ((start, end),) = result.report["blocks"]
    bridged = start - 1
    assert result.report["replaceme"]["maps"][0]["span"] == [bridged, end]
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    transform = naive_least_squares_map(original, batches, bridged, residual_streams(original, batches, end))
    before, after = _writers(original.model.layers[bridged]), _writers(model.model.layers[bridged])
    assert before.keys() == after.keys() and before
    for name, weight in before.items():
        expected = transform.T @ weight.double()  # broadcast over the experts of a 3-d parameter
        torch.testing.assert_close(after[name].double(), expected, atol=2e-5, rtol=1e-4, msg=name)
    kept = {n for n, _ in original.model.layers[bridged].named_parameters()} - {f"mlp.{w}" for w in before}
    reference = dict(original.model.layers[bridged].named_parameters())
    for name, parameter in model.model.layers[bridged].named_parameters():
        if name in kept:
            assert torch.equal(parameter, reference[name]), name
    # What mode 'changed' heals is exactly those writers.
    names = changed_parameter_names(model, result.report)
    assert sorted(names) == sorted(f"model.layers.{bridged}.mlp.{w}" for w in after)


@pytest.mark.parametrize("family", MOE)
def test_the_down_refit_is_refused_on_a_mixture_before_any_change(family):
    model = tiny_models.FACTORIES[family]()
    assert_refused_before_any_change(
        model, "replaceme", "lstsq_down.*router over experts", estimator="lstsq_down", num_layers_to_remove=2
    )
    assert_refused_before_any_change(
        model, "shortgpt", "lstsq_down.*router over experts", linear_replacement="lstsq_down", num_layers_to_remove=2
    )


def test_a_bridge_after_any_method_applies_on_a_mixture(tmp_path):
    from common import assert_reloads_with_plain_transformers

    model = tiny_models.FACTORIES["qwen2_moe"]()
    before = logits(model, sample_ids())
    result = compress(model, "shortgpt", num_layers_to_remove=2, linear_replacement="lstsq")
    assert result.report["linear_replacement"]["maps"]
    assert not torch.equal(logits(model, sample_ids()), before)
    assert_reloads_with_plain_transformers(model, tmp_path)


@pytest.mark.parametrize("estimator", ["lstsq", "lstsq_down"])
def test_granite_fits_what_the_stream_receives_times_its_residual_multiplier(estimator):
    model = tiny_models.FACTORIES["granite"]()
    multiplier = model.config.residual_multiplier
    assert multiplier != 1.0  # the tiny model exercises it
    original = copy.deepcopy(model)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator=estimator, down_ridge=0.0)
    result = compress(model, config)
    ((start, end),) = result.report["blocks"]
    bridged = start - 1
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    targets = residual_streams(original, batches, end)
    layer = original.model.layers[bridged]
    if estimator == "lstsq":
        m, y, target = naive_fit_rows(original, batches, bridged, targets)
        transform = torch.linalg.lstsq(multiplier * m, target - y).solution
        expected = transform.T @ layer.mlp.down_proj.weight.double()
    else:  # the down projection refitted on its inputs: multiplier · a W'ᵀ ≈ L − Y, without a ridge
        a, y, target = _rows(original, batches, targets, layer.mlp.down_proj, layer.post_attention_layernorm, False)
        expected = torch.linalg.lstsq(multiplier * a, target - y).solution.T
    got = model.model.layers[bridged].mlp.down_proj.weight.double()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def _rows(model, batches, targets, x_module, y_module, x_is_output: bool):
    """(X, Y, L) in float64 over every real token of `batches`, from full forwards of `model`: X what `x_module`
    returns (`x_is_output`) or reads, Y what `y_module` reads, L the target."""
    captured = {}
    if x_is_output:
        x_hook = x_module.register_forward_hook(lambda _m, _a, out: captured.__setitem__("x", out))
    else:
        x_hook = x_module.register_forward_pre_hook(lambda _m, args: captured.__setitem__("x", args[0]))
    handles = [x_hook, y_module.register_forward_pre_hook(lambda _m, args: captured.__setitem__("y", args[0]))]
    rows: tuple[list, list, list] = ([], [], [])
    try:
        for batch, target in zip(batches, targets, strict=True):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            keep = batch.attention_mask.bool()
            for out, value in zip(rows, (captured["x"], captured["y"], target), strict=True):
                out.append(value[keep].double())
    finally:
        for handle in handles:
            handle.remove()
    return tuple(torch.cat(r) for r in rows)


POST_NORM = {  # family -> the norm applied to the MLP's output before the add
    "gemma2": "post_feedforward_layernorm",
    "gemma3_text": "post_feedforward_layernorm",
    "olmo2": "post_feedforward_layernorm",
    "glm4": "post_mlp_layernorm",
}


def _gain(family: str, norm) -> torch.Tensor:
    """What the norm multiplies by: Gemma's ``1 + weight``, the weight elsewhere."""
    weight = norm.weight.detach().double()
    return 1.0 + weight if family.startswith("gemma") else weight


@pytest.mark.parametrize("family", sorted(POST_NORM))
def test_a_diagonal_map_folds_into_the_norm_after_the_mlp_exactly(family):
    model = tiny_models.FACTORIES[family]().double()
    adapter = get_adapter(model)
    ids = sample_ids()
    generator = torch.Generator().manual_seed(5)
    layer = model.model.layers[2]
    norm = layer.get_submodule(POST_NORM[family])
    scales = 1.0 + 0.5 * torch.randn(model.config.hidden_size, generator=generator, dtype=torch.float64)
    handle = norm.register_forward_hook(lambda _m, _a, out: out * scales)
    with torch.no_grad():
        expected = logits(model, ids)
    handle.remove()
    others = {
        n: p.clone() for n, p in model.named_parameters() if not n.startswith(f"model.layers.2.{POST_NORM[family]}")
    }
    adapter.fold_after_mlp_(layer, 2, torch.diag(scales))
    with torch.no_grad():  # Gemma's norms compute in float32 whatever the model's dtype: its rounding, no more
        tolerance = 1e-6 if family.startswith("gemma") else 1e-10
        torch.testing.assert_close(logits(model, ids), expected, atol=tolerance, rtol=tolerance)
    assert all(torch.equal(p, others[n]) for n, p in model.named_parameters() if n in others)
    with pytest.raises(ValueError, match="only a diagonal map"):
        adapter.fold_after_mlp_(layer, 2, torch.diag(scales) + 1e-3)


@pytest.mark.parametrize("family", sorted(POST_NORM))
def test_replaceme_diagonal_is_the_naive_per_channel_least_squares_on_what_the_stream_receives(family):
    model = tiny_models.FACTORIES[family]()
    original = copy.deepcopy(model)
    assert_refused_before_any_change(copy.deepcopy(model), "replaceme", "diagonal", num_layers_to_remove=2)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator="diagonal")
    result = compress(model, config)
    ((start, end),) = result.report["blocks"]
    bridged = start - 1
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    targets = residual_streams(original, batches, end)
    block = original.model.layers[bridged]
    norm = block.get_submodule(POST_NORM[family])
    # The stream the MLP sublayer adds to: what its pre-norm reads, or (OLMo-2, no pre-norm) the MLP itself.
    reads = block.mlp if family == "olmo2" else get_adapter(original).block_view(block, bridged).mlp_norm.module
    p, y, target = _rows(original, batches, targets, norm, reads, x_is_output=True)
    scales = (p * (target - y)).sum(0) / (p * p).sum(0)
    got = _gain(family, model.model.layers[bridged].get_submodule(POST_NORM[family]))
    torch.testing.assert_close(got, _gain(family, norm) * scales, atol=1e-5, rtol=1e-4)
    kept = dict(original.model.layers[bridged].named_parameters())
    for name, parameter in model.model.layers[bridged].named_parameters():
        if not name.startswith(POST_NORM[family]):
            assert torch.equal(parameter, kept[name]), name


def test_the_diagonal_solve_against_per_channel_least_squares_with_a_dead_channel():
    from optimum_flatten.ops.linear_map import LinearMapStatistics, solve_diagonal

    generator = torch.Generator().manual_seed(0)
    m = torch.randn(2, 50, 6, generator=generator, dtype=torch.float64)
    m[..., 3] = 0.0  # never excited: keeps its gain
    r = torch.randn(2, 50, 6, generator=generator, dtype=torch.float64)
    mask = torch.ones(2, 50)
    mask[1, 40:] = 0  # padding is left out
    stats = LinearMapStatistics(6)
    stats.update(m, r, mask)
    transform, _ = solve_diagonal(stats)
    keep = mask.bool()
    rows, targets = m[keep], r[keep]
    expected = (rows * targets).sum(0) / (rows * rows).sum(0)
    expected[3] = 1.0
    torch.testing.assert_close(transform, torch.diag(expected), atol=1e-12, rtol=1e-10)
