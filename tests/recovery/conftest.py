"""The compressed model the healing tests start from (one per test module, as each module's own fixture was)."""

from __future__ import annotations

import copy

import pytest

import tiny_models
from common import compress


@pytest.fixture(scope="module")
def compressed():
    """(dense teacher, FlattenGPT 6 -> 4 with a linear bridge, its report)."""
    dense = tiny_models.tiny_llama_gqa()
    model = copy.deepcopy(dense)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2, linear_replacement="lstsq")
    return dense, model, dict(quantizer.report)
