"""ShortGPT's iterative loop (Prune&Comp, Algorithm 1) against a naive loop that really drops and folds each round."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids, tiny_config
from optimum_flatten import FlattenConfig
from optimum_flatten.calibration.data import build_calibration_batches


def _config(n: int, **options) -> FlattenConfig:
    return tiny_config("shortgpt", num_layers_to_remove=n, **options)


def _negligible_norm_eps(model) -> None:
    """The virtual walk (a layer run on α·x) equals the folded model up to the norms' ε; a negligible ε isolates the
    loop itself from that approximation, which the compensation tests bound separately."""
    for module in model.modules():
        if isinstance(getattr(module, "variance_epsilon", None), float):
            module.variance_epsilon = 1e-12


@torch.no_grad()
def _stream(model, batches) -> list[torch.Tensor]:
    """Real-token states entering every layer and leaving the last (before the final norm), float64."""
    captured: list[list[torch.Tensor]] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: captured[-1].append(args[0]))
    per_batch = []
    for batch in batches:
        captured.append([])
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        states = list(hidden.hidden_states[:-1]) + captured[-1]  # the last hidden state is after the norm
        keep = batch.attention_mask.bool()
        per_batch.append([h[keep].double() for h in states])
    handle.remove()
    return [torch.cat([b[i] for b in per_batch]) for i in range(len(per_batch[0]))]


@torch.no_grad()
def _naive_loop(model, batches, n: int, compensate: bool) -> list[int]:
    """Each round: BI of the current model from full forwards, drop the lowest, measure α on the current model and
    fold it into the embedding and every o/down projection below the cut (and the final norm when tied)."""
    original_index = list(range(len(model.model.layers)))
    dropped = []
    for _ in range(n):
        states = _stream(model, batches)
        scores = [
            1 - float(torch.nn.functional.cosine_similarity(states[i], states[i + 1], dim=-1).mean())
            for i in range(len(states) - 1)
        ]
        j = min(range(len(scores)), key=lambda i: (scores[i], original_index[i]))
        if compensate:
            alpha = float((states[j + 1].abs().mean(0) / states[j].abs().mean(0)).mean())
            model.model.embed_tokens.weight.mul_(alpha)
            for layer in model.model.layers[:j]:
                layer.self_attn.o_proj.weight.mul_(alpha)
                layer.mlp.down_proj.weight.mul_(alpha)
            if model.lm_head.weight is model.model.embed_tokens.weight:
                model.model.norm.weight.div_(alpha)
        dropped.append(original_index.pop(j))
        del model.model.layers[j]
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = i
        model.config.num_hidden_layers -= 1
    return dropped


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("compensation", [None, "scale"])
def test_iterative_loop_equals_dropping_and_folding_one_layer_per_round(tied, compensation):
    model = tiny_models.FACTORIES["llama_gqa"]()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    _negligible_norm_eps(model)
    reference = copy.deepcopy(model)
    config = _config(3, iterative=True, compensation=compensation)
    quantizer = compress(model, config)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    dropped = _naive_loop(reference, batches, 3, compensate=compensation == "scale")
    rounds = quantizer.report["block_influence_rounds"]
    assert [r["dropped"] for r in rounds] == dropped
    assert sorted(dropped) == quantizer.plan.dropped_indices
    if compensation:
        assert list(quantizer.report["compensation"]["alpha"]) == [str(i) for i in sorted(dropped)]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = sample_ids(batch=2, length=16, seed=3)
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=2e-5, rtol=1e-4)


def test_one_round_is_the_one_pass_plan_and_compensation_changes_the_later_rounds():
    model = tiny_models.FACTORIES["qwen3"]()
    one_pass = compress(copy.deepcopy(model), _config(1)).plan
    assert compress(copy.deepcopy(model), _config(1, iterative=True)).plan.dropped_indices == one_pass.dropped_indices
    plain = compress(copy.deepcopy(model), _config(3, iterative=True)).report["block_influence_rounds"]
    scaled = compress(copy.deepcopy(model), _config(3, iterative=True, compensation="scale"))
    rounds = scaled.report["block_influence_rounds"]
    # The first round sees the same model either way; after a compensated drop the later layers' scores move.
    assert rounds[0]["block_influence"] == plain[0]["block_influence"]
    assert rounds[1]["block_influence"] != plain[1]["block_influence"]
    assert all("alpha" in r for r in rounds)
    assert scaled.report["compensation"]["alpha"] == {
        str(r["dropped"]): r["alpha"] for r in sorted(rounds, key=lambda r: r["dropped"])
    }


def test_iterative_must_be_a_bool():
    with pytest.raises(ValueError, match="iterative must be True or False"):
        _config(1, iterative="yes")
