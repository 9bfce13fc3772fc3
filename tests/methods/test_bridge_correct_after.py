"""correct_after: the kept layers after a bridge get their own least-squares map, checked against a naive fit."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, naive_least_squares_map, residual_streams, tiny_config
from optimum_flatten import FlattenConfig
from optimum_flatten.calibration.data import build_calibration_batches


def _config(**options) -> FlattenConfig:
    return tiny_config("replaceme", num_layers_to_remove=2, tokens="all", **options)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen3"])
def test_the_layer_after_the_bridge_gets_the_naive_least_squares_map_on_the_bridged_model(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    bridged = copy.deepcopy(model)
    plain = compress(bridged, _config())
    corrected = compress(model, _config(correct_after=1))
    assert corrected.plan.group_lists() == plain.plan.group_lists()
    ((start, end),) = corrected.report["blocks"]
    maps = corrected.report["replaceme"]["maps"]
    assert [m["span"] for m in maps] == [[start - 1, end], [end, end + 1]]
    if end + 1 > len(original.model.layers):
        pytest.skip("the block ends the stack: no kept layer after it")
    batches = build_calibration_batches(tiny_models.CharTokenizer(), _config().calibration)
    targets = residual_streams(original, batches, end + 1)  # the dense stream leaving original layer `end`
    transform = naive_least_squares_map(bridged, batches, start, targets)  # output layer `start` is original `end`
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
