"""correct_after: the kept layers after a bridge get their own least-squares map, checked against a naive fit."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.calibration.data import build_calibration_batches


def _config(**options) -> FlattenConfig:
    return FlattenConfig(
        method="replaceme",
        num_layers_to_remove=2,
        dataset=tiny_models.sample_texts(),
        nsamples=8,
        seqlen=24,
        tokens="all",
        **options,
    )


def _compress(model, config) -> FlattenQuantizer:
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    return quantizer


@torch.no_grad()
def _dense_state_after(original, batches, layer: int) -> list[torch.Tensor]:
    """Per batch, the dense residual stream leaving original layer `layer` (before the final norm for the last)."""
    captured = {}
    handle = original.model.norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("out", args[0]))
    states = []
    for batch in batches:
        hidden = original(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
        ).hidden_states
        states.append(captured["out"] if layer + 1 == len(original.model.layers) else hidden[layer + 1])
    handle.remove()
    return states


@torch.no_grad()
def _naive_fit(model, batches, k: int, targets: list[torch.Tensor]) -> torch.Tensor:
    """lstsq of (target - Y) on M over real tokens, M and Y of output layer k from full forwards of `model`."""
    layer = model.model.layers[k]
    seen = {}
    handles = [
        layer.mlp.register_forward_hook(lambda _m, _a, out: seen.__setitem__("m", out)),
        layer.post_attention_layernorm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("y", args[0])),
    ]
    ms, rs = [], []
    for batch, target in zip(batches, targets, strict=True):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        keep = batch.attention_mask.bool()
        ms.append(seen["m"][keep].double())
        rs.append((target - seen["y"])[keep].double())
    for handle in handles:
        handle.remove()
    return torch.linalg.lstsq(torch.cat(ms), torch.cat(rs)).solution


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen3"])
def test_the_layer_after_the_bridge_gets_the_naive_least_squares_map_on_the_bridged_model(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    bridged = copy.deepcopy(model)
    plain = _compress(bridged, _config())
    corrected = _compress(model, _config(correct_after=1))
    assert corrected.plan.group_lists() == plain.plan.group_lists()
    ((start, end),) = corrected.report["blocks"]
    maps = corrected.report["replaceme"]["maps"]
    assert [m["span"] for m in maps] == [[start - 1, end], [end, end + 1]]
    if end + 1 > len(original.model.layers):
        pytest.skip("the block ends the stack: no kept layer after it")
    batches = build_calibration_batches(tiny_models.CharTokenizer(), _config().calibration)
    targets = _dense_state_after(original, batches, end)
    transform = _naive_fit(bridged, batches, start, targets)  # output layer `start` is original layer `end`
    expected = transform.T @ bridged.model.layers[start].mlp.down_proj.weight.double()
    got = model.model.layers[start].mlp.down_proj.weight.double()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # Everything before the correction is the plain bridge.
    for k in range(start):
        torch.testing.assert_close(
            model.model.layers[k].mlp.down_proj.weight, bridged.model.layers[k].mlp.down_proj.weight
        )


def test_correct_after_is_checked():
    with pytest.raises(ValueError, match="correct_after must be a non-negative integer"):
        _config(correct_after=-1)
