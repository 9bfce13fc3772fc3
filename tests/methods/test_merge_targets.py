"""Targets that merging methods (FlattenGPT, CoMe, LaCo, Sliding-Window Merging) cannot reach: refused before the
calibration, with layer kinds (sliding and full attention, NoPE) counted, and never stranded by a greedy step when a
plan exists."""

from __future__ import annotations

import math

import pytest
import torch

import tiny_models
from common import assert_refused_before_any_change
from optimum_flatten.methods.flattengpt.method import FlattenGPTMethod
from optimum_flatten.ops.selection import greedy_adjacent_groups, max_merges


def _old_greedy(similarity, num_to_remove, limit, one_kind):
    """FlattenGPT's Algorithm 1 as written before the feasibility check: the most similar admissible pair each step."""
    groups = [[i] for i in range(similarity.shape[0])]
    for _ in range(num_to_remove):
        best, best_score = None, -math.inf
        for g in range(len(groups) - 1):
            a, b = groups[g], groups[g + 1]
            if len(a) + len(b) > limit or not one_kind((*a, *b)):
                continue
            if float(similarity[a[0], b[-1]]) > best_score:
                best, best_score = g, float(similarity[a[0], b[-1]])
        if best is None:
            return None
        groups[best : best + 2] = [groups[best] + groups[best + 1]]
    return [tuple(g) for g in groups]


def test_a_greedy_step_that_would_strand_the_target_is_skipped():
    similarity = torch.full((6, 6), 0.5)
    similarity[1, 2] = 0.99  # (1, 2) first would leave 0, 3, 4, 5 with one pair to merge within groups of two
    assert _old_greedy(similarity, 3, 2, lambda g: True) is None
    assert greedy_adjacent_groups(similarity, 3, 2) == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize("seed", range(40))
def test_every_plan_the_greedy_found_before_is_found_again(seed):
    generator = torch.Generator().manual_seed(seed)
    layers = 8
    similarity = torch.rand(layers, layers, generator=generator)
    kinds = torch.randint(0, 2, (layers,), generator=generator).tolist() if seed % 2 else [0] * layers
    one_kind = lambda group: len({kinds[i] for i in group}) == 1  # noqa: E731
    limit = (2, 3, layers)[seed % 3]
    for n in range(1, layers):
        old = _old_greedy(similarity, n, limit, one_kind)
        possible = max_merges([(i,) for i in range(layers)], limit, one_kind)
        if old is not None:
            assert greedy_adjacent_groups(similarity, n, limit, one_kind) == old
        elif n <= possible:  # a plan exists: the greedy now finds one
            groups = greedy_adjacent_groups(similarity, n, limit, one_kind)
            assert len(groups) == layers - n and all(len(g) <= limit and one_kind(g) for g in groups)
        else:
            with pytest.raises(ValueError):
                greedy_adjacent_groups(similarity, n, limit, one_kind)


def _no_calibration(monkeypatch):
    def calibrated(*args, **kwargs):
        raise AssertionError("the calibration ran before the refusal")

    monkeypatch.setattr(FlattenGPTMethod, "similarity_matrix", calibrated)
    monkeypatch.setattr("optimum_flatten.methods.come.CoMeMethod.plan", calibrated)


def test_flattengpt_counts_layer_kinds_before_the_calibration(monkeypatch):
    """SmolLM3's NoPE layers (2 and 5 of 6) split the stack into runs of 2, 1, 2, 1: two merges at most, whatever
    max_group_size says, so asking three is refused before calibrating, and the advice is not to raise it."""
    _no_calibration(monkeypatch)
    model = tiny_models.tiny_smollm3()
    message = r"at most 2 within max_group_size=6; remove fewer layers"
    assert_refused_before_any_change(model, "flattengpt", message, num_layers_to_remove=3, max_group_size=6)


def test_flattengpt_says_when_a_larger_group_would_help(monkeypatch):
    _no_calibration(monkeypatch)
    model = tiny_models.tiny_qwen2(max_window_layers=3)  # full attention on 0-2, sliding on 3-5
    message = r"at most 2 within max_group_size=2; raise max_group_size or remove fewer layers"
    assert_refused_before_any_change(model, "flattengpt", message, num_layers_to_remove=3, max_group_size=2)


def test_come_counts_layer_kinds_before_the_calibration(monkeypatch):
    _no_calibration(monkeypatch)
    model = tiny_models.tiny_smollm3()
    assert_refused_before_any_change(model, "come", r"at most 2 \(allow_chaining=True\)", num_layers_to_remove=3)


@pytest.mark.parametrize("method", ["laco", "sliding_window"])
def test_window_merges_count_layer_kinds_before_the_calibration(monkeypatch, method):
    """LaCo and Sliding-Window Merging used to score every window on the calibration before saying that the NoPE
    layers (2 and 5) leave one merge in their default range [1, 5] (runs 1, 2, 3-4, 5); the range counts alone too."""
    monkeypatch.setattr("optimum_flatten.methods.laco.search.StackEvaluator.__init__", _calibrated)
    model = tiny_models.tiny_smollm3()
    message = r"the layer range \[1, 5\] can lose at most 1 that way, fewer than the 2 requested"
    assert_refused_before_any_change(model, method, message, num_layers_to_remove=2)
    message = r"the layer range \[1, 3\] holds 3 layers, so merging within it can remove at most 2"
    assert_refused_before_any_change(model, method, message, num_layers_to_remove=3, max_layer=3)


def _calibrated(*args, **kwargs):
    raise AssertionError("the calibration ran before the refusal")


@pytest.mark.parametrize(("method", "options"), [("laco", {"window_size": 2}), ("sliding_window", {})])
def test_window_merges_reach_what_the_kinds_allow(method, options):
    """The count is a bound, not a promise: LaCo's windows of 4 span a NoPE layer wherever they stand here."""
    from common import compress

    model = tiny_models.tiny_smollm3()
    quantizer = compress(model, method, num_layers_to_remove=2, threshold=None, min_layer=0, **options)
    assert sorted(quantizer.plan.merged_groups) == [(0, 1), (3, 4)]


def test_reachable_targets_still_compress():
    from common import compress

    quantizer = compress(tiny_models.tiny_smollm3(), "flattengpt", num_layers_to_remove=2, max_group_size=6)
    assert sorted(g for g in quantizer.plan.merged_groups) == [(0, 1), (3, 4)]


def test_qwen25s_inert_window_boundary_is_no_layer_kind():
    """Qwen2.5's released configs keep max_window_layers (21 of 24) with the sliding window off: every layer is full
    attention, yet the boundary split the stack into two kinds, refusing targets and keeping merges across it out of
    every plan. Off, it is no kind: the same model with the boundary anywhere plans alike."""
    from transformers import Qwen2Config

    from common import compress
    from optimum_flatten import get_adapter

    def model(boundary):
        config = Qwen2Config(**tiny_models._common(num_key_value_heads=2, use_sliding_window=False,
                                                   max_window_layers=boundary))  # fmt: skip
        return tiny_models._build(config, 0)

    assert get_adapter(model(3)).layer_kind_rule("decoder")((2, 3))
    plans = [compress(model(b), "flattengpt", num_layers_to_remove=3).plan for b in (3, 6)]
    assert plans[0] == plans[1] and len(plans[0].merged_groups) == 3


def test_greedy_replace_flattens_only_pairs_of_one_kind():
    """SmolLM3's NoPE layers (2 and 5): greedy_replace's flatten action could take the pair [2, 3] (on a text where it
    scored best) and have the plan refused after its whole search, with range advice it has no option for."""
    from optimum_flatten import get_adapter
    from optimum_flatten.compression.method import MethodContext
    from optimum_flatten.methods.greedy_replace import GreedyReplaceMethod, _Current
    from optimum_flatten.options.methods.greedy_replace import GreedyReplaceConfig

    adapter = get_adapter(tiny_models.tiny_smollm3())
    method = GreedyReplaceMethod(GreedyReplaceConfig(allow_flatten=True))
    layers = list(adapter.layers("decoder"))
    current = _Current(adapter, None, layers, {}, list(range(6)), MethodContext(batches=[], stack="decoder"))
    assert [p for p in range(5) if method._flattenable(current, p)] == [0, 3]  # (0, 1) and (3, 4)
