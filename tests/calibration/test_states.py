"""The states engine against full-model forwards: boundaries, walk, cosines and the row-bounded NLL."""

from __future__ import annotations

import re

import pytest
import torch

import tiny_models
from common import sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.calibration.states import cosine_rows, next_token_nll
from optimum_flatten.compression.method import MethodContext


def _context(ids, mask):
    return MethodContext(
        batches=[CalibrationBatch(ids[:2], mask[:2]), CalibrationBatch(ids[2:], mask[2:])], progress=False
    )


@pytest.mark.parametrize("keep", [None, (), (3,)])
def test_boundaries_equal_the_model_hidden_states_whatever_is_cached(keep):
    model = tiny_models.FACTORIES["qwen2"]()
    ids = sample_ids(batch=4, length=20, seed=1)
    mask = torch.ones_like(ids)
    mask[3, 15:] = 0
    states = _context(ids, mask).new_states(get_adapter(model), keep=keep)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for i in (4, 1, 5, 0):  # out of order: recomputed from the nearest cached boundary below
        got = torch.cat(states.boundary(i))
        torch.testing.assert_close(got[mask.bool()], hidden[i][mask.bool()], atol=1e-5, rtol=1e-5)
    walked = [torch.cat(after) for _, _, after in states.walk()]
    torch.testing.assert_close(walked[2][mask.bool()], hidden[3][mask.bool()], atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError, match="boundary 7 does not exist"):
        states.boundary(7)


def test_cosine_rows_take_the_last_real_token_under_left_and_right_padding():
    a = torch.randn(3, 5, 4)
    b = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    last = cosine_rows(a, b, mask, "last")
    expected = torch.nn.functional.cosine_similarity(a[[0, 1], [2, 4]].double(), b[[0, 1], [2, 4]].double(), dim=-1)
    torch.testing.assert_close(last, expected)  # the all-padding row contributes nothing
    assert cosine_rows(a, b, mask, "all").numel() == 6
    with pytest.raises(ValueError, match="tokens must be 'last' or 'all'"):
        cosine_rows(a, b, mask, "first")


def test_next_token_nll_equals_the_model_loss_over_real_pairs():
    model = tiny_models.FACTORIES["llama_gqa"]()
    ids = sample_ids(batch=4, length=16, seed=2)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    context = _context(ids, mask)
    states = context.new_states(get_adapter(model))
    nll = next_token_nll(get_adapter(model), states.boundary(6), context.batches)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    valid = (mask[:, :-1] & mask[:, 1:]).bool()
    expected = torch.nn.functional.cross_entropy(logits[valid], ids[:, 1:][valid])
    assert nll == pytest.approx(float(expected), rel=1e-5)


def test_first_batches_are_the_engine_of_a_calibration_on_those_batches_only():
    """`scoring_batches` in one place: the cut-down engine's states, masks, token ids and NLL are those of an engine
    built from the first batches alone (the reference shares no runner with it)."""
    from optimum_flatten.calibration.states import CalibratedStates

    model = tiny_models.FACTORIES["llama_gqa"]()
    adapter = get_adapter(model)
    ids = sample_ids(batch=4, length=16, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    context = _context(ids, mask)
    states = CalibratedStates.on_first_batches(
        context.new_runner(adapter), adapter.layers("decoder"), context.batches, num_batches=1
    )
    alone = MethodContext(batches=context.batches[:1], progress=False)
    reference = alone.new_states(adapter)
    assert states.num_batches == 1 and states.batches == context.batches[:1]
    assert torch.equal(states.masks[0], reference.masks[0])
    assert torch.equal(states.boundary(6)[0], reference.boundary(6)[0])
    assert states.next_token_nll(adapter, states.boundary(6)) == next_token_nll(
        adapter, reference.boundary(6), alone.batches
    )
    everything = CalibratedStates.on_first_batches(
        context.new_runner(adapter), adapter.layers("decoder"), context.batches, num_batches=None
    )
    assert everything.num_batches == 2 and everything.batches == list(context.batches)
    with pytest.raises(ValueError, match="built without their calibration batches"):
        reference.next_token_nll(adapter, reference.boundary(6))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_scoring_batches_is_checked_once_for_every_method(bad):
    from optimum_flatten.calibration.states import check_scoring_batches
    from optimum_flatten.methods.ffn_merge import FfnMergeConfig
    from optimum_flatten.methods.laco import LaCoConfig
    from optimum_flatten.methods.sleb import SLEBConfig

    check_scoring_batches(None)
    check_scoring_batches(3)
    message = f"scoring_batches must be a positive integer or None, got {bad!r}"
    for make in (
        lambda: check_scoring_batches(bad),
        *(lambda c=c: c(scoring_batches=bad) for c in (SLEBConfig, LaCoConfig, FfnMergeConfig)),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            make()


@pytest.mark.parametrize("family", ["llama_gqa", "gemma3_text"])
def test_released_layer_zero_states_are_recorded_again_bit_for_bit(family):
    """A walk past layer 0 releases the layer-0 states (`CalibratedStates.release_layer_zero`: a copy of the
    calibration states fewer for the rest of the walk); whoever reads them later gets them recorded again, the
    same tensors bit for bit (Gemma scales its embeddings: recorded through the model's own forward as before),
    and so the same boundaries above them. A runner cut to its first batches records those batches only."""
    model = tiny_models.FACTORIES[family]()
    ids = sample_ids(batch=4, length=20, seed=2)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    states = _context(ids, mask).new_states(get_adapter(model), keep=())
    first = [x.clone() for x in states.boundary(0)]
    second = [x.clone() for x in states.boundary(2)]
    states.release_layer_zero()
    assert states.runner._inputs is None and 0 not in states._cache  # nothing holds the copy now
    assert all(torch.equal(a, b) for a, b in zip(states.runner.inputs, first, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(states.boundary(2), second, strict=True))
    runner = states.runner
    runner.inputs = runner.inputs[:1]
    runner.masks = runner.masks[:1]
    runner.release_inputs()
    assert len(runner.inputs) == runner.num_batches == 1 and torch.equal(runner.inputs[0], first[0])
