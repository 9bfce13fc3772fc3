"""The compute a method reports, in passes of the calibration tokens through the original stack, is exact."""

from __future__ import annotations

import tiny_models
from common import compress
from optimum_flatten.utils.torch_utils import count_parameters


def _compress(method: str, **kwargs):
    model = tiny_models.tiny_llama_gqa()
    layer_weights = count_parameters(model.model.layers[0])
    head_weights = count_parameters(model.lm_head)
    quantizer = compress(model, method, num_layers_to_remove=1, **kwargs)
    return quantizer.report["cost"]["stack_passes"], layer_weights, head_weights


def test_shortgpt_costs_one_pass():
    passes, _, _ = _compress("shortgpt")
    assert passes == 1.0


def test_sleb_cost_counts_every_suffix_rerun_and_lm_head_evaluation():
    passes, layer_weights, head_weights = _compress("sleb")
    num_layers = 6
    # One pass to get every layer's input, then for each candidate removal the layers above it (L(L-1)/2 layer
    # runs), and one LM-head evaluation per candidate; all layers of the tiny model have equal weights.
    expected = 1 + (num_layers - 1) / 2 + num_layers * head_weights / (num_layers * layer_weights)
    assert abs(passes - expected) < 1e-3
