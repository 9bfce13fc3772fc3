"""ffn_merge's cheaper window search (top window first, candidates resumed across rounds, optional early exit)
computes what the previous search computed: the same windows and every score, to the last bit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tiny_models
from common import compress, padded_batches
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
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


# ------------------------------------------------------------------------------------ score_at="window"
@torch.no_grad()
def _layer_outputs(model, replaced: dict, index: int, batches) -> list[torch.Tensor]:
    """The output of layer `index` on every batch, from a plain forward of a copy of `model` whose layers in
    `replaced` are swapped for the given modules (the naive reference: no layerwise runner, no cached states)."""
    reference = copy.deepcopy(model)
    layers = get_adapter(reference).layers("decoder")
    for i, module in replaced.items():
        layers[i] = copy.deepcopy(module)
    outputs = []
    hook = layers[index].register_forward_hook(
        lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        for batch in batches:
            reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        hook.remove()
    return outputs


def _masked_mean_cosine(a: list[torch.Tensor], b: list[torch.Tensor], batches) -> float:
    total, count = 0.0, 0
    for x, y, batch in zip(a, b, batches, strict=True):
        cos = torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1)[batch.attention_mask.bool()]
        total, count = total + float(cos.sum()), count + cos.numel()
    return total / count


@torch.no_grad()
def _naive_window_search(model, batches, config: FfnMergeConfig) -> tuple[list, list[list[float]]]:
    """Greedy rounds in which a candidate's score is the masked token cosine between the output of its window's last
    layer with the window merged and without, each on a full forward of the model with the earlier rounds' windows
    merged."""
    adapter = get_adapter(model)
    method = FfnMergeMethod(config)
    scorer = WindowScorer(adapter, MethodContext(batches=batches, stack="decoder", progress=False), config)
    chosen, committed, rounds = [], {}, []
    num_rounds = config.resolved_num_windows
    for round_index in range(num_rounds):
        best = best_value = best_blocks = None
        scores = []
        for window in method.candidate_windows(adapter, "decoder", chosen, num_rounds - round_index - 1):
            blocks = method._candidate_blocks(adapter, "decoder", [window], scorer)
            merged = _layer_outputs(model, {**committed, **blocks}, window[-1], batches)
            unmerged = _layer_outputs(model, committed, window[-1], batches)
            value = _masked_mean_cosine(merged, unmerged, batches)
            scores.append(value)
            if best is None or value > best_value:
                best, best_value, best_blocks = window, value, blocks
        rounds.append(scores)
        chosen.append(best)
        committed.update(best_blocks)
    return sorted(chosen), rounds


@pytest.mark.parametrize(
    ("factory", "options"),
    [("llama_gqa", {"window_size": 2, "num_windows": 2}), ("gpt2", {"window_size": 2, "num_windows": 2})],
)
def test_window_scores_equal_a_naive_full_forward_reference(factory, options):
    model = tiny_models.FACTORIES[factory]()
    batches = _batches()
    windows, rounds = _naive_window_search(model, batches, FfnMergeConfig(**options))
    report, work = _plan(model, batches, FfnMergeConfig(**options, score_at="window"))
    assert report["ffn_score_at"] == "window"
    assert _windows(report) == windows
    scores = [[entry["score"] for entry in scored] for scored in report["ffn_window_scores"]]
    assert len(scores) == len(rounds)
    for ours, naive in zip(scores, rounds, strict=True):
        assert ours == pytest.approx(naive, abs=2e-6)
    # The final score is the output cosine of the chosen windows, as the output search reports it.
    explicit, _ = _plan(model, batches, FfnMergeConfig(window_starts=[w[0] for w in windows], **options))
    assert report["ffn_final_score"] == pytest.approx(explicit["ffn_final_score"], abs=1e-12)
    _, output_work = _plan(model, batches, FfnMergeConfig(**options))
    assert work < output_work


def test_window_scoring_with_early_exit_keeps_the_windows():
    model = tiny_models.tiny_llama_gqa()
    batches = _batches(num=4)
    options = {"window_size": 2, "num_windows": 2, "score_at": "window"}
    full, _ = _plan(model, batches, FfnMergeConfig(**options))
    early, _ = _plan(model, batches, FfnMergeConfig(**options, early_exit=True))
    assert _windows(early) == _windows(full) and early["ffn_final_score"] == full["ffn_final_score"]


def test_window_scoring_refuses_a_next_token_loss_and_unknown_places():
    with pytest.raises(ValueError, match="score_at='window' compares the window's output states by cosine"):
        FfnMergeConfig(score_at="window", selection="nll")
    with pytest.raises(ValueError, match="score_at"):
        FfnMergeConfig(score_at="middle")


def test_a_shortlist_rescores_the_best_windows_by_the_final_states():
    """With `shortlist`, each round's winner is, among the windows the window score ranks best, the one the output
    score (the naive search's criterion) prefers; a shortlist of every candidate chooses what the output search
    chooses, with the same final score."""
    model = tiny_models.tiny_llama_gqa()
    batches = _batches()
    options = {"window_size": 2, "num_windows": 2}
    _, rounds = _naive_window_search(model, batches, FfnMergeConfig(**options))
    output_windows, output_rounds, output_final, _ = _previous_search(model, batches, FfnMergeConfig(**options))
    report, _ = _plan(model, batches, FfnMergeConfig(**options, score_at="window", shortlist=2))
    chosen = _windows(report)
    # The first round's window scores are the naive ones (later rounds follow another winner than the naive search).
    assert [e["score"] for e in report["ffn_window_scores"][0]] == pytest.approx(rounds[0], abs=2e-6)
    for scored in report["ffn_window_scores"]:
        shortlisted = [e for e in scored if "output_score" in e]
        assert len(shortlisted) == 2
        best_local = sorted((e for e in scored), key=lambda e: (-e["score"], e["start"]))[:2]
        assert {e["start"] for e in shortlisted} == {e["start"] for e in best_local}
        winner = max(shortlisted, key=lambda e: (e["output_score"], -e["start"]))
        assert tuple(winner["layers"]) in chosen
    everything, _ = _plan(model, batches, FfnMergeConfig(**options, score_at="window", shortlist=100))
    assert _windows(everything) == output_windows
    assert everything["ffn_final_score"] == pytest.approx(output_final, abs=1e-12)
    first_round = {e["start"]: e["output_score"] for e in everything["ffn_window_scores"][0]}
    assert list(first_round.values()) == pytest.approx(output_rounds[0], abs=1e-12)


def test_a_shortlist_needs_window_scores_in_full():
    with pytest.raises(ValueError, match="needs score_at='window'"):
        FfnMergeConfig(shortlist=3)
    with pytest.raises(ValueError, match="early_exit=True"):
        FfnMergeConfig(score_at="window", shortlist=3, early_exit=True)
    with pytest.raises(ValueError, match="shortlist"):
        FfnMergeConfig(score_at="window", shortlist=0)
