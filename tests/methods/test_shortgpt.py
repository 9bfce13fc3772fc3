from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.shortgpt import block_influence


def _naive_block_influence(model, ids):
    captured = {}
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.setdefault("last", args[0]))
    with torch.no_grad():
        states = list(model(input_ids=ids, output_hidden_states=True).hidden_states[: model.config.num_hidden_layers])
    handle.remove()
    states.append(captured["last"])  # the last layer's output before the final norm
    scores = []
    for i in range(model.config.num_hidden_layers):
        a, b = states[i].double().flatten(0, 1), states[i + 1].double().flatten(0, 1)
        cos = [float(a[t] @ b[t] / (a[t].norm() * b[t].norm())) for t in range(a.shape[0])]
        scores.append(1 - sum(cos) / len(cos))
    return torch.tensor(scores, dtype=torch.float64)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "qwen3"])
def test_block_influence_matches_naive_and_lowest_are_dropped(factory):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=3)
    context = MethodContext(batches=[CalibrationBatch(ids, torch.ones_like(ids))], progress=False)
    scores = block_influence(get_adapter(model), context)
    reference = _naive_block_influence(model, ids)
    torch.testing.assert_close(scores, reference, atol=1e-6, rtol=0)

    original = copy.deepcopy(model)
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    bi = torch.tensor(quantizer.report["block_influence"])
    dropped = quantizer.plan.dropped_indices
    assert len(dropped) == 2
    assert max(bi[dropped]) <= min(bi[[i for i in range(6) if i not in dropped]])
    assert model.config.num_hidden_layers == 4
    assert not torch.allclose(logits(model, ids), logits(original, ids), atol=1e-3)
