"""ReplaceMe's bridge on mixtures of experts (issue 30): the map after a layer's MLP output is folded into every
expert's down projection, the shared expert's and a dense layer's own, which is exact because the MLP output is a
sum of their outputs weighted by gates that read the stream before the map.

Checked against naive references: the fold against the map applied after the MLP by a hook, in float64; the folded
weights against ``Tᵀ W`` with T from torch.linalg.lstsq on full forwards of the dense model; the down refit, which
needs one dense down projection, is refused before any weight changes."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import (
    assert_refused_before_any_change,
    compress,
    logits,
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
