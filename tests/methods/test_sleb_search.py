"""SLEB's cheaper search computes what scoring every candidate on every batch computes, bit for bit.

References written here: the exhaustive search as SLEB ran it before the early exit (the states of the current
stack recomputed each step, every candidate's suffix run on all batches, `next_token_nll` on all of them), and a
naive one from full-model forwards of freshly built shallower models.
"""

from __future__ import annotations

import pytest
import torch

import tiny_models
from common import compress, padded_batches, shallower_reference
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.calibration.states import (
    CalibratedStates,
    next_token_nll,
    next_token_nll_terms,
    next_token_pairs,
)
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.sleb import SLEBConfig, SLEBMethod, _Search


def _batches(num: int = 4, seed: int = 11) -> list[CalibrationBatch]:
    """`num` batches of 2 rows x 16 tokens; the second row of the second batch is right-padded."""
    return padded_batches(num, seed, padded=(1, 1, 5))


def _states(model, batches) -> tuple[object, MethodContext, CalibratedStates]:
    adapter = get_adapter(model)
    context = MethodContext(batches=batches, progress=False)
    states = CalibratedStates.on_first_batches(
        context.new_runner(adapter), adapter.layers("decoder"), batches, None, keep=()
    )
    return adapter, context, states


@torch.no_grad()
def _exhaustive(model, batches, num_to_remove: int, protected=()) -> tuple[list[int], list[float]]:
    """SLEB as it was: each step recomputes the current stack's states, scores every candidate on every batch."""
    adapter, _, states = _states(model, batches)
    kept, removed, nlls = list(range(states.num_layers)), [], []
    for _ in range(num_to_remove):
        boundaries = [states.boundary(0)]
        for index in kept:
            boundaries.append(states.run_layers([index], boundaries[-1]))
        scores = {}
        for position, index in enumerate(kept):
            if index in protected:
                continue
            final = states.run_layers(kept[position + 1 :], boundaries[position])
            scores[index] = next_token_nll(adapter, final, states.batches, "decoder")
        chosen = min(scores, key=lambda i: (scores[i], i))
        removed.append(chosen)
        nlls.append(scores[chosen])
        kept.remove(chosen)
    return removed, nlls


@torch.no_grad()
def _full_model_nll(model, batches) -> float:
    """Mean next-token NLL over pairs of real tokens, from one ordinary forward per batch."""
    total, count = 0.0, 0
    for batch in batches:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        valid = (batch.attention_mask[:, :-1] * batch.attention_mask[:, 1:]).bool()
        losses = torch.nn.functional.cross_entropy(
            out[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
        )
        total, count = total + float(losses[valid].sum()), count + int(valid.sum())
    return total / count


def _naive(model, batches, num_to_remove: int, protected=()) -> tuple[list[int], list[float]]:
    """Every candidate scored by a full forward of a freshly built model without that layer."""
    kept, removed, nlls = list(range(model.config.num_hidden_layers)), [], []
    for _ in range(num_to_remove):
        scores = {
            i: _full_model_nll(shallower_reference(model, [k for k in kept if k != i]), batches)
            for i in kept
            if i not in protected
        }
        chosen = min(scores, key=lambda i: (scores[i], i))
        removed.append(chosen)
        nlls.append(scores[chosen])
        kept.remove(chosen)
    return removed, nlls


def _search(model, batches, num_to_remove: int, resume: bool = True, protected=()) -> tuple[_Search, list]:
    adapter, context, states = _states(model, batches)
    search = _Search.start(adapter, context, states, set(protected))
    results = [
        search.step(resume and step < num_to_remove - 1, last=step == num_to_remove - 1)
        for step in range(num_to_remove)
    ]
    return search, results


def _sharp(factory: str, scale: float = 30.0):
    """A tiny model whose LM head is scaled up: sharper logits, so the candidates' NLLs lie further apart."""
    model = tiny_models.FACTORIES[factory]()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def _hopeless_bottom(factory: str):
    """A tiny model whose first layer writes a huge value along hidden unit 0, which a sharpened LM head (x100) does
    not read: with that layer the normalised final state is nearly unit 0 and the logits nearly flat (NLL about
    log V); without it they are sharp and random (an NLL several times larger). Removing layer 0 is then hopeless,
    and the search, which scores it last, stops it early."""
    model = tiny_models.FACTORIES[factory]()
    with torch.no_grad():
        down = model.model.layers[0].mlp.down_proj.weight
        down.zero_()
        down[0, :] = 1000.0
        model.lm_head.weight.mul_(100.0)
        model.lm_head.weight[:, 0] = 0.0
    return model


# ----------------------------------------------------------------------------------------- the engine's pieces
def test_one_batch_runs_and_row_terms_are_the_whole_batch_computation_bit_for_bit():
    model = tiny_models.tiny_qwen2()
    batches = _batches()
    adapter, _, states = _states(model, batches)
    layers = [1, 3, 4]
    together = states.run_layers(layers, states.boundary(0))
    work = states.runner.work
    for b in range(len(batches)):
        assert torch.equal(states.run_layers_on_batch(layers, states.boundary(0)[b], b), together[b])
    assert states.runner.work == 2 * work  # the same work counted, batch by batch
    total, count = 0.0, 0
    for hidden, batch in zip(together, batches, strict=True):
        for nll, pairs in next_token_nll_terms(adapter, hidden, batch, "decoder"):
            total, count = total + nll, count + pairs
    assert count == next_token_pairs(batches) == 4 * 2 * 15 - 5
    assert total / count == next_token_nll(adapter, together, batches, "decoder")


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize(
    ("factory", "variant"), [("llama_gqa", None), ("qwen2", None), ("llama_gqa", "sharp"), ("qwen3", "hopeless")]
)
def test_search_equals_the_exhaustive_search_bit_for_bit_and_the_naive_one(factory, variant):
    model = {
        None: tiny_models.FACTORIES[factory],
        "sharp": lambda: _sharp(factory),
        "hopeless": lambda: _hopeless_bottom(factory),
    }[variant]()
    batches = _batches()
    removed, nlls = _exhaustive(model, batches, 3)
    search, results = _search(model, batches, 3)
    assert [r.removed for r in results] == removed
    assert [r.nll for r in results] == nlls  # the same floats, not merely close
    naive_removed, naive_nlls = _naive(model, batches, 3)
    assert naive_removed == removed
    assert nlls == pytest.approx(naive_nlls, rel=1e-5)
    assert search.kept == sorted(set(range(6)) - set(removed))


def test_method_report_and_plan_equal_the_exhaustive_search_with_protection():
    model = _hopeless_bottom("llama_gqa")
    batches = _batches()
    removed, nlls = _exhaustive(model, batches, 2, protected={0, 5})
    context = MethodContext(batches=batches, progress=False)
    plan = SLEBMethod(SLEBConfig(protect_first=True, protect_last=True)).plan(get_adapter(model), context, 2)
    assert [s["removed"] for s in context.report["sleb_steps"]] == removed
    assert [s["nll"] for s in context.report["sleb_steps"]] == [round(v, 6) for v in nlls]
    assert plan.first_indices == sorted(set(range(6)) - set(removed))


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_early_exit_triggers_and_changes_nothing(factory):
    model = _hopeless_bottom(factory)
    batches = _batches()
    removed, nlls = _exhaustive(model, batches, 3)
    search, results = _search(model, batches, 3)
    assert search.early_exits > 0 and sum(r.candidates_cut for r in results) > 0
    assert [(r.removed, r.nll) for r in results] == list(zip(removed, nlls, strict=True))


def test_resumed_candidates_change_nothing_and_save_layer_runs():
    model = _sharp("qwen2")
    batches = _batches()
    resumed, resumed_results = _search(model, batches, 3, resume=True)
    plain, plain_results = _search(model, batches, 3, resume=False)
    assert [(r.removed, r.nll) for r in resumed_results] == [(r.removed, r.nll) for r in plain_results]
    assert plain.resumed_batches == 0
    # Candidates below the layers removed first resumed from their stored states: fewer layer runs.
    assert resumed.resumed_batches > 0
    assert resumed.states.runner.work < plain.states.runner.work


@pytest.mark.parametrize("num_batches", [1, 4])
def test_a_tie_goes_to_the_lower_layer(num_batches):
    """Layers 2 and 3 made exact identities (zero attention and MLP outputs): removing either gives the same
    states, the same NLL to the last bit, and the lower index must win as `min(score, index)` decides. The search
    scores the top layer first, so 3 is complete, and the best, when 2 ties it."""
    model = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        for i in (2, 3):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    batches = _batches()[:num_batches]
    adapter, context, states = _states(model, batches)
    search = _Search.start(adapter, context, states, set())
    result, _ = search._score_all([2, 3], keep_resume_states=False)
    assert result.removed == 2
    assert search.scores[2] == search.scores[3] == result.nll
    removed, _ = _exhaustive(model, batches, 1)
    _, results = _search(model, batches, 1)
    assert results[0].removed == removed[0]


def test_reported_cost_is_below_the_exhaustive_search_and_the_counter_is_reported():
    model = _hopeless_bottom("llama_gqa")
    quantizer = compress(model, "sleb", num_layers_to_remove=3)
    report = quantizer.report
    layers = 6
    layer_weights = sum(p.numel() for p in tiny_models.tiny_llama_gqa().model.layers[0].parameters())
    head_weights = model.lm_head.weight.numel()
    exhaustive = sum(k + k * (k - 1) / 2 + k * head_weights / layer_weights for k in range(layers, layers - 3, -1))
    assert report["cost"]["stack_passes"] < exhaustive / layers
    assert isinstance(report["sleb_early_exits"], int) and isinstance(report["sleb_resumed_batches"], int)
    assert all("candidates_cut" in step for step in report["sleb_steps"])


def test_resume_candidates_must_be_a_bool():
    with pytest.raises(TypeError, match="resume_candidates must be True or False"):
        SLEBConfig(resume_candidates=1)
