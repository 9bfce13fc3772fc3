"""ffn_merge's cheaper window search (top window first, candidates resumed across rounds, optional early exit)
computes what the previous search computed: the same windows and every score, to the last bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tiny_models
from common import compress, padded_batches
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.methods.base import MethodContext
from optimum_flatten.methods.ffn_merge import FfnMergeConfig, FfnMergeMethod, WindowScorer


def _batches(num: int = 3, seed: int = 21) -> list[CalibrationBatch]:
    """`num` batches of 2 rows x 16 tokens; one row right-padded."""
    return padded_batches(num, seed, padded=(1, 0, 6))


@torch.no_grad()
def _previous_search(model, batches, config: FfnMergeConfig) -> tuple[list, list[list[float]], float, int]:
    """The search as it was: every candidate, in start order, run over all batches at once from its window's
    start and scored by `WindowScorer.score`; the first strictly better one kept; the states recomputed after each
    round. Returns the windows, every round's scores, the final score and the work it took."""
    adapter = get_adapter(model)
    method = FfnMergeMethod(config)
    context = MethodContext(batches=batches, progress=False)
    scorer = WindowScorer(adapter, dataclasses.replace(context, stack="decoder"), config)
    chosen, committed, states, rounds = [], {}, scorer.states, []
    num_rounds = config.resolved_num_windows
    final = None
    for round_index in range(num_rounds):
        still_to_place = num_rounds - round_index - 1
        best = best_value = best_blocks = None
        scores = []
        for window in method.candidate_windows(adapter, "decoder", chosen, still_to_place):
            blocks = method._candidate_blocks(adapter, "decoder", [window], scorer)
            value = scorer.score(scorer.run_from(window[0], {**committed, **blocks}, states))
            scores.append(value)
            if best is None or scorer.better(value, best_value):
                best, best_value, best_blocks = window, value, blocks
        rounds.append(scores)
        chosen.append(best)
        committed.update(best_blocks)
        final = best_value
        if still_to_place:
            states = FfnMergeMethod._states_with(scorer, committed, states, best[0])
    return sorted(chosen), rounds, final, context.work


def _plan(model, batches, config: FfnMergeConfig) -> tuple[dict, int]:
    context = MethodContext(batches=batches, progress=False)
    FfnMergeMethod(config).plan(get_adapter(model), context, 0)
    return context.report, context.work


def _windows(report: dict) -> list[tuple[int, ...]]:
    return [tuple(group["layers"]) for group in report["ffn_groups"]]


@pytest.mark.parametrize(
    ("factory", "options"),
    [
        ("llama_gqa", {"window_size": 2, "num_windows": 2}),
        ("llama_gqa", {"window_size": 2, "num_windows": 3, "selection": "nll"}),
        ("qwen2", {"window_size": 2, "num_windows": 2, "anchor": "last"}),
        ("gpt2", {"window_size": 3, "num_windows": 1}),
    ],
)
def test_search_equals_the_previous_one_bit_for_bit(factory, options):
    model = tiny_models.FACTORIES[factory]()
    batches = _batches()
    config = FfnMergeConfig(**options)
    windows, rounds, final, previous_work = _previous_search(model, batches, config)
    report, work = _plan(model, batches, FfnMergeConfig(**options))
    assert _windows(report) == windows
    assert [[entry["score"] for entry in scored] for scored in report["ffn_window_scores"]] == rounds
    assert report["ffn_final_score"] == final
    if config.resolved_num_windows > 1:  # candidates below the first window resumed from their stored states
        assert report["ffn_search"]["resumed_batches"] > 0
        assert work < previous_work
    else:
        assert report["ffn_search"]["resumed_batches"] == 0
        assert work == previous_work


@pytest.mark.parametrize("selection", ["cosine", "nll"])
def test_early_exit_keeps_the_windows_and_the_final_score(selection):
    model = tiny_models.tiny_llama_gqa()
    batches = _batches(num=4)
    options = {"window_size": 2, "num_windows": 2, "selection": selection}
    full, full_work = _plan(model, batches, FfnMergeConfig(**options))
    early, early_work = _plan(model, batches, FfnMergeConfig(**options, early_exit=True))
    assert _windows(early) == _windows(full)
    assert early["ffn_final_score"] == full["ffn_final_score"]
    better = (lambda a, b: a > b) if selection == "cosine" else (lambda a, b: a < b)
    for exact, fast in zip(full["ffn_window_scores"], early["ffn_window_scores"], strict=True):
        winner = max(exact, key=lambda e: e["score"]) if selection == "cosine" else min(exact, key=lambda e: e["score"])
        for a, b in zip(exact, fast, strict=True):
            if b["score"] is None:  # stopped: its bound already lost, and its score is no better than the bound
                assert not better(b["bound"], winner["score"]) and not better(a["score"], b["bound"])
            else:
                assert b["score"] == a["score"]
    if selection == "cosine":  # merged random layers differ a lot in cosine: some candidates stop early
        assert early["ffn_search"]["early_exits"] > 0
        assert early_work < full_work


def test_resume_off_gives_the_same_report_at_the_previous_cost():
    model = tiny_models.tiny_llama_gqa()
    batches = _batches()
    on, on_work = _plan(model, batches, FfnMergeConfig(window_size=2, num_windows=2))
    off, off_work = _plan(model, batches, FfnMergeConfig(window_size=2, num_windows=2, resume_candidates=False))
    assert {k: v for k, v in on.items() if k != "ffn_search"} == {k: v for k, v in off.items() if k != "ffn_search"}
    assert off["ffn_search"]["resumed_batches"] == 0 < on["ffn_search"]["resumed_batches"]
    assert _previous_search(model, batches, FfnMergeConfig(window_size=2, num_windows=2))[3] == off_work > on_work


def test_sync_stacks_with_resume_and_early_exit_choose_the_same_windows():
    runs = {}
    for name, options in {
        "plain": {"resume_candidates": False},
        "resume": {},
        "early": {"early_exit": True},
    }.items():
        quantizer = compress(
            tiny_models.tiny_marian(), "ffn_merge", window_size=2, num_windows=2, sync_stacks=True, **options
        )
        runs[name] = quantizer.report
    for name in ("resume", "early"):
        assert runs[name]["ffn_groups"] == runs["plain"]["ffn_groups"]
        assert runs[name]["ffn_final_scores_by_stack"] == runs["plain"]["ffn_final_scores_by_stack"]
    assert runs["resume"]["ffn_window_scores"] == runs["plain"]["ffn_window_scores"]


def test_new_options_must_be_bools():
    for name in ("resume_candidates", "early_exit"):
        with pytest.raises((TypeError, ValueError), match=name):
            FfnMergeConfig(**{name: "yes"})
