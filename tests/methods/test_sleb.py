from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids, shallower_reference
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.sleb import SLEBConfig, SLEBMethod


def _naive_nll(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen3"])
def test_sleb_matches_naive_iterative_removal(factory):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=2)
    kept, naive_removed = list(range(6)), []
    for _ in range(2):
        scores = {i: _naive_nll(shallower_reference(model, [k for k in kept if k != i]), ids) for i in kept if i != 0}
        removed = min(scores, key=lambda i: (scores[i], i))
        naive_removed.append(removed)
        kept.remove(removed)
    context = MethodContext(batches=[CalibrationBatch(ids, torch.ones_like(ids))], progress=False)
    plan = SLEBMethod(SLEBConfig(protect_first=True)).plan(get_adapter(model), context, 2)
    assert [step["removed"] for step in context.report["sleb_steps"]] == naive_removed
    assert plan.first_indices == kept


def test_sleb_compresses_and_changes_outputs():
    model = tiny_models.tiny_qwen2()
    original = copy.deepcopy(model)
    compress(model, "sleb", num_layers_to_remove=2)
    assert model.config.num_hidden_layers == 4 and len(model.config.layer_types) == 4
    ids = sample_ids()
    assert not torch.allclose(logits(model, ids), logits(original, ids), atol=1e-3)


def test_sleb_protection_that_leaves_too_few_layers_is_refused():
    model = tiny_models.tiny_llama_gqa()
    with pytest.raises(ValueError, match="only 4 layers can be removed"):
        compress(model, "sleb", num_layers_to_remove=5, protect_first=True, protect_last=True)
    assert model.config.num_hidden_layers == 6
