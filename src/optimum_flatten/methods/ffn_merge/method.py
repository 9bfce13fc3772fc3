"""FFN merging (Verma et al., "Merging Feed-Forward Sublayers for Compressed Transformers"): k adjacent
feed-forward sublayers share one averaged set of parameters.

For a window of k adjacent layers, every non-anchor layer's hidden units are permuted to line up with an anchor
layer's (a linear assignment on the correlation of their activations over calibration tokens; exactly
function-preserving per layer), the k aligned MLPs are averaged, and the k layers then use that one MLP, tied
(one tensor in memory). The window is chosen by sliding over every start position, scoring each candidate on the
calibration text (similarity of the final hidden states to the original model's, or the next-token NLL) and
keeping the best; several windows are placed greedily, each scored with the earlier ones already merged.

With ``sync_stacks=True`` the windows are placed "in sync" on every stack of the model (Marian's encoder and
decoder, as the paper does for OPUS-MT): one set of window positions, merged in each stack in one compression. A
candidate position is scored by the mean over the stacks of each stack's cosine score; each stack is scored with the
other stacks as they are (unmerged), since the decoder's cached calibration states hold the original encoder's
output. That keeps one cached pass per stack (no re-run of the decoder for every encoder candidate) at the price of
ignoring how an encoder merge shifts the decoder's inputs; the final compression merges both.

The method keeps every layer (``keeps_depth = True``): its plan is the identity LayerPlan, and what it shared is
reported in ``report["ffn_groups"]`` (one entry per stack and window), which `retie_ffn_` reads to restore the
sharing after a plain reload.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.states import (
    cosine_rows,
)
from ...compression.method import CardSection, CompressionMethod, MethodContext
from ...options.methods.ffn_merge import FfnMergeConfig
from ...plan import LayerPlan
from ...registry import register_method
from ...utils.offload import is_offloaded
from .footprint import parameter_footprint, parameters_text
from .scoring import Resume, WindowScorer, merged_mlp
from .tying import Window, check_same_layout, retie_ffn_, tie_mlps_, write_mlp_

logger = logging.getLogger(__name__)


def check_windows_fit(num_layers: int, config: FfnMergeConfig) -> None:
    """Raises when the requested windows cannot fit a stack of `num_layers` layers (before any work is done)."""
    k, n = config.window_size, config.resolved_num_windows
    if k > num_layers:
        raise ValueError(
            f"window_size={k} is larger than the stack of {num_layers} layers; choose window_size <= {num_layers}."
        )
    if k * n > num_layers:
        raise ValueError(
            f"{n} non-overlapping windows of {k} layers need {k * n} layers, the stack has {num_layers}; "
            "lower num_windows or window_size."
        )
    if config.window_starts is not None:
        bad = [s for s in config.window_starts if s + k > num_layers]
        if bad:
            raise ValueError(
                f"window_starts {bad} run past the last layer of a stack of {num_layers} layers with window_size={k}; "
                f"allowed starts are 0..{num_layers - k}."
            )


def _room(num_layers: int, used: set[int], k: int) -> int:
    """How many windows of k adjacent layers still fit between the used layers (a simple upper bound for the
    later rounds: it ignores layout mismatches, which the later round reports)."""
    room, run = 0, 0
    for i in range(num_layers + 1):
        if i < num_layers and i not in used:
            run += 1
        else:
            room, run = room + run // k, 0
    return room


@dataclasses.dataclass(frozen=True)
class _SoFar:
    """What every candidate of a round is built and scored against, per stack: its scorer, the merged blocks of the
    windows chosen so far, and the states entering each layer with them merged. A round, its shortlist's rescoring
    and each candidate's score read the same model, so they take this one object (`_choose` updates its dicts)."""

    adapter: ArchitectureAdapter
    scorers: Mapping[str, WindowScorer]
    committed: Mapping[str, Mapping[int, nn.Module]]
    states: Mapping[str, Sequence[Sequence[torch.Tensor]]]


# ---------------------------------------------------------------------------------------------- the method
@register_method("ffn_merge")
class FfnMergeMethod(CompressionMethod):
    """Aligns, averages and ties the feed-forward sublayers of windows of adjacent layers; keeps every layer."""

    config_class = FfnMergeConfig
    reads_mlp_projections = True
    requires_calibration = True
    #: Aligning and averaging feed-forward channels needs one dense MLP per layer (a mixture of experts has none).
    required_capabilities = frozenset({"dense_mlp"})
    #: Read by FlattenConfig and FlattenQuantizer: no layer count target, and the plan must be the identity.
    keeps_depth: ClassVar[bool] = True
    multi_stack_option: ClassVar[str | None] = "sync_stacks=True to merge the same windows in every stack"
    config: FfnMergeConfig

    def __init__(self, config: FfnMergeConfig) -> None:
        super().__init__(config)
        self._windows: list[Window] | None = None
        self._scorers: dict[str, WindowScorer] = {}
        #: What the search skipped: stack-batches resumed from a stored state, and stack-batches of candidates that
        #: stopped early (the batch they stopped in and the ones after it), over all rounds.
        self._search = {"resumed_batches": 0, "early_exits": 0}

    # ------------------------------------------------------------------------------------- lifecycle hooks
    def stacks_to_compress(self, adapter: ArchitectureAdapter, requested: Sequence[str]) -> list[str]:
        """With `sync_stacks` the method merges every stack itself in one compression, so it must be handed all of
        them (the quantizer then reports the identity plan on the model's last stack); else one stack, as usual."""
        if not self.config.sync_stacks:
            return super().stacks_to_compress(adapter, requested)
        if sorted(requested) != sorted(adapter.stacks()):
            raise ValueError(
                f"method {self.name!r} with sync_stacks=True merges every stack {adapter.stacks()} in one "
                f"compression, got stacks={list(requested)}; leave stacks unset, or drop sync_stacks to merge one "
                "stack."
            )
        return list(adapter.stacks())

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """The shared sublayers, why the file is as large as the base model's, and its two parameter counts.

        Read from ``ffn_groups`` (and the ``ffn_*`` counts) whatever the report's method, as the card always did.
        """
        if not report.get("ffn_groups"):
            return None
        architecture = report.get("architecture", "transformers")
        groups = [g["layers"] for g in report["ffn_groups"]]
        summary = (
            f"This is an ordinary `{architecture}` checkpoint whose layers {groups} share their feed-forward "
            "parameters. The stock format has no way to say that two layers use one MLP (its config gives every "
            "layer its own, and `model.safetensors` stores no aliases), so each layer's copy is stored in full: "
            "the file is as large as the base model's, and a plain `from_pretrained` loads as many parameters as "
            "the base has. That is what makes it load with plain `transformers` and every tool built on it; "
            f"`optimum_flatten.methods.{cls.name}.retie_ffn_(model, report)` (with flatten_report.json) makes the "
            "identical copies one tensor again, and only then is the model smaller, in memory."
        )
        lines = tuple(
            f"- Feed-forward sublayers shared by layers {group['layers']} ({group.get('stack', 'decoder')})"
            for group in report["ffn_groups"]
        )
        return CardSection(summary=summary, lines=lines, parameters=parameters_text(report))

    @property
    def _scorer(self) -> WindowScorer | None:
        """The scorer of the only (or first) merged stack; kept for callers of the one-stack method."""
        return next(iter(self._scorers.values()), None)

    def merged_stacks(self, adapter: ArchitectureAdapter, stack: str) -> list[str]:
        """The stacks one compression merges: every stack of the model with `sync_stacks`, else `stack`."""
        return list(adapter.stacks()) if self.config.sync_stacks else [stack]

    def candidate_windows(
        self, adapter: ArchitectureAdapter, stack: str | Sequence[str], taken: Sequence[Window], still_to_place: int = 0
    ) -> list[Window]:
        """Every window of `window_size` adjacent layers that overlaps no taken window, can be tied, and leaves room
        for `still_to_place` more windows (so a greedy choice never strands the later rounds).

        With several stacks (in sync) a window must be a candidate in every one of them.
        """
        stacks = [stack] if isinstance(stack, str) else list(stack)
        k = self.config.window_size
        used = {i for w in taken for i in w}
        windows = []
        for start in range(min(adapter.num_layers(s) for s in stacks) - k + 1):
            window = tuple(range(start, start + k))
            if used.intersection(window):
                continue
            if any(_room(adapter.num_layers(s), used | set(window), k) < still_to_place for s in stacks):
                continue
            try:
                for s in stacks:
                    check_same_layout(adapter, s, window)
            except ValueError:
                logger.info("ffn_merge: layers %s have different MLP layouts and are not a candidate", list(window))
                continue
            windows.append(window)
        return windows

    @torch.no_grad()
    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        """Chooses the windows (and their alignments) without touching the model; returns the identity plan."""
        if num_to_remove != 0:
            raise ValueError(f"ffn_merge keeps every layer; it cannot remove {num_to_remove}.")
        cfg = self.config
        stacks = self.merged_stacks(adapter, context.stack)
        for stack in stacks:
            try:
                check_windows_fit(adapter.num_layers(stack), cfg)
            except ValueError as error:
                raise ValueError(f"{stack} stack: {error}" if cfg.sync_stacks else str(error)) from None
        if is_offloaded(adapter.model):
            raise ValueError(
                "ffn_merge does not support offloaded models yet (tied tensors must live in memory on one device); "
                "load the model without an offloading device_map."
            )
        if cfg.selection == "nll" and adapter.lm_head(context.stack) is None:
            raise ValueError("selection='nll' needs a language-model head, and this model has none; use 'cosine'.")
        if cfg.window_starts is not None:
            for stack in stacks:
                for start in cfg.window_starts:
                    check_same_layout(adapter, stack, tuple(range(start, start + cfg.window_size)))
        # One scorer per stack, sharing the context's timers, work count and report (dataclasses.replace passes the
        # same dict and list objects on).
        scorers = {s: WindowScorer(adapter, dataclasses.replace(context, stack=s), cfg) for s in stacks}
        self._search = {"resumed_batches": 0, "early_exits": 0}
        windows, rounds, final_scores = self._choose(adapter, scorers)
        if final_scores is None:  # explicit windows, or windows scored locally: one run with all, from the first
            final_scores = {}
            for stack, scorer in scorers.items():
                blocks = self._candidate_blocks(adapter, stack, windows, scorer)
                final_scores[stack] = scorer.score(scorer.run_from(windows[0][0], blocks, scorer.states))
        final_score = sum(final_scores.values()) / len(final_scores)
        self._windows, self._scorers = windows, scorers
        context.report["ffn_groups"] = [
            {"stack": s, "layers": list(w), "anchor": cfg.anchor_of(w), "variant": cfg.variant, "tied": cfg.tie}
            for s in stacks
            for w in windows
        ]
        context.report["ffn_window_scores"] = rounds
        context.report["ffn_selection"] = cfg.selection
        context.report["ffn_score_at"] = cfg.score_at
        context.report["ffn_final_score"] = final_score
        if cfg.window_starts is None:
            context.report["ffn_search"] = dict(self._search)
        if cfg.sync_stacks:
            context.report["ffn_final_scores_by_stack"] = final_scores
        shared = [list(w) for w in windows]
        logger.info(
            "ffn_merge: sharing the MLPs of layers %s in %s (%s %.6f)", shared, stacks, cfg.selection, final_score
        )
        num_layers = adapter.num_layers(context.stack)
        return LayerPlan.from_kept(num_layers, range(num_layers), stack=context.stack)

    def _candidate_blocks(
        self, adapter: ArchitectureAdapter, stack: str, windows: Sequence[Window], scorer: WindowScorer
    ) -> dict[int, nn.Module]:
        """Detached copies of the windows' layers carrying their merged MLP (the model itself is untouched)."""
        blocks = {}
        for window in windows:
            merged = merged_mlp(adapter, stack, window, self.config, scorer)
            for i in window:
                view = adapter.detached_block(stack, i)
                write_mlp_(view.mlp, merged)
                blocks[i] = view.module
        return blocks

    def _window_blocks(self, so_far: _SoFar, window: Window) -> dict[str, dict[int, nn.Module]]:
        """`window`'s merged blocks in every stack (`_candidate_blocks`)."""
        return {s: self._candidate_blocks(so_far.adapter, s, [window], sc) for s, sc in so_far.scorers.items()}

    def _choose(
        self, adapter: ArchitectureAdapter, scorers: Mapping[str, WindowScorer]
    ) -> tuple[list[Window], list[list[dict]], dict[str, float] | None]:
        """The explicit windows, or a greedy search: per round, the best non-overlapping window given earlier ones.

        A candidate's score is the mean of its scores on the stacks in `scorers` (one stack unless in sync).
        Returns the windows, the scores of every round, and the per-stack scores of the final choice (None for
        explicit windows, and for windows scored at the window without a shortlist: their scores are not final-state
        scores, so `plan` runs the final states once). Otherwise the winner of the last round is run with every
        chosen window merged, from the cached state at its start, which the earlier rounds left computed with their
        windows merged: the very run a fresh pass from the first window would repeat, so its score is the final
        score. For the same reason the winner's merged blocks are kept and committed as scored, not rebuilt, and the
        last round updates no states.
        """
        k = self.config.window_size
        if self.config.window_starts is not None:
            return [tuple(range(s, s + k)) for s in self.config.window_starts], [], None
        chosen: list[Window] = []
        committed: dict[str, dict[int, nn.Module]] = {s: {} for s in scorers}
        states = {s: scorer.states for s, scorer in scorers.items()}
        rounds = []
        final_scores: dict[str, float] = {}
        resume = Resume()
        so_far = _SoFar(adapter, scorers, committed, states)
        num_rounds = self.config.resolved_num_windows
        for round_index in range(num_rounds):
            still_to_place = num_rounds - round_index - 1
            candidates = self.candidate_windows(adapter, list(scorers), chosen, still_to_place)
            if not candidates:
                raise ValueError(
                    f"no window of {k} identically shaped, unmerged adjacent layers is left for window "
                    f"{round_index + 1} of {num_rounds}; lower num_windows or window_size."
                )
            keep = self.config.resume_candidates and still_to_place > 0 and self.config.score_at == "output"
            best, best_blocks, best_by_stack, scored, resume = self._score_round(
                so_far, candidates, resume, keep, round_index
            )
            rounds.append(scored)
            chosen.append(best)
            final_scores = best_by_stack
            for stack, scorer in scorers.items():
                committed[stack].update(best_blocks[stack])
                if still_to_place:
                    states[stack] = self._states_with(scorer, committed[stack], states[stack], best[0])
        if self.config.score_at == "window" and self.config.shortlist is None:
            return sorted(chosen), rounds, None  # the rounds scored windows locally: the final states are not run yet
        return sorted(chosen), rounds, final_scores

    def _score_round(
        self,
        so_far: _SoFar,
        candidates: Sequence[Window],
        resume: Resume,
        keep: bool,
        round_index: int,
    ) -> tuple[Window, dict[str, dict[int, nn.Module]], dict[str, float], list[dict], Resume]:
        """Scores one round's candidates; returns the winner, its blocks and per-stack scores, every candidate's
        entry (in start order) and what the next round resumes from.

        The winner is the one the scan in start order with a strict `better` picks (the first of equal scores),
        exactly as before. The candidates are *scored* top window first, though: a candidate below the best so
        far stores its states entering the best window (when `keep`), and a new best makes those of no use. Every
        candidate below the round's winner is scored after the winner has become the best (a tie with a lower
        window moves the best down, as the winner would), so all of them leave their states for the next round,
        which has the winner merged. With `early_exit`, the candidates scored when the best is known stop once
        their bound loses.
        """
        first = next(iter(so_far.scorers.values()))
        entries: dict[Window, dict] = {}
        values: dict[Window, tuple[float, dict[str, float]]] = {}
        best: Window | None = None
        best_blocks: dict[str, dict[int, nn.Module]] = {}
        stored = Resume()
        desc = f"window {round_index + 1}: scoring candidates"
        with first.context.progress_bar(len(candidates), desc) as bar:
            for window in sorted(candidates, reverse=True):
                store_at = best[0] if keep and best is not None and best[0] > window[-1] else None
                blocks = self._window_blocks(so_far, window)
                against = None if best is None or not self.config.early_exit else (best, values[best][0])
                value, by_stack, bound = self._score_candidate(
                    so_far, window, blocks, resume, store_at, stored, against
                )
                entries[window] = {"start": window[0], "layers": list(window), "score": value}
                if value is None:
                    entries[window]["bound"] = bound
                    bar.update()
                    continue
                values[window] = (value, by_stack)
                if best is None or first.better(value, values[best][0]) or value == values[best][0]:
                    best, best_blocks, stored = window, blocks, Resume(window[0])
                del blocks  # only the best candidate's blocks stay alive
                bar.update()
        winner = None
        for window in candidates:  # the choice as the scan in start order made it
            if window in values and (winner is None or first.better(values[window][0], values[winner][0])):
                winner = window
        assert winner is not None  # the first candidate scored is never stopped: nothing to stop it against
        if winner != best:  # only with scores that compare unequal to themselves (NaN): rebuild, resume nothing
            best_blocks = self._window_blocks(so_far, winner)
            stored = Resume()
        by_stack = values[winner][1]
        if self.config.shortlist is not None:
            winner, best_blocks, by_stack = self._rescore_shortlist(so_far, values, entries)
        return winner, best_blocks, by_stack, [entries[w] for w in candidates], stored

    def _rescore_shortlist(
        self,
        so_far: _SoFar,
        values: Mapping[Window, tuple[float, dict[str, float]]],
        entries: Mapping[Window, dict],
    ) -> tuple[Window, dict[str, dict[int, nn.Module]], dict[str, float]]:
        """`shortlist`: the `shortlist` best windows by their window score (the earlier start first among equals),
        each scored by the final states with the committed windows merged; the best of those (the earlier start
        among equals) wins. Adds ``output_score`` to the shortlisted entries."""
        scorers, committed, states = so_far.scorers, so_far.committed, so_far.states
        first = next(iter(scorers.values()))
        ranked = sorted(values, key=lambda w: (-values[w][0], w[0]))[: self.config.shortlist]
        winner: Window | None = None
        winner_value = 0.0
        winner_blocks: dict[str, dict[int, nn.Module]] = {}
        winner_by_stack: dict[str, float] = {}
        for window in sorted(ranked):
            blocks = self._window_blocks(so_far, window)
            by_stack = {
                stack: scorer.score(scorer.run_from(window[0], {**committed[stack], **blocks[stack]}, states[stack]))
                for stack, scorer in scorers.items()
            }
            value = sum(by_stack.values()) / len(by_stack)
            entries[window]["output_score"] = value
            if winner is None or first.better(value, winner_value):
                winner, winner_value, winner_blocks, winner_by_stack = window, value, blocks, by_stack
        assert winner is not None
        return winner, winner_blocks, winner_by_stack

    def _score_candidate(
        self,
        so_far: _SoFar,
        window: Window,
        blocks: Mapping[str, Mapping[int, nn.Module]],
        resume: Resume,
        store_at: int | None,
        stored: Resume,
        against: tuple[Window, float] | None,
    ) -> tuple[float | None, dict[str, float] | None, float | None]:
        """The score with `window` merged on top of the committed windows (mean over the stacks) and each stack's
        score, computed batch by batch; or, once its bound loses to `against` (the best window and its score),
        ``(None, None, bound)``.

        At the output (the default), each batch starts from the cached state at the window's start, or from the
        state `resume` holds for it; with `store_at`, the state entering that layer is stored in `stored`. Every
        number is the one the run over all batches at once computes. At the window, see `_window_terms`.
        """
        scorers, committed, states = so_far.scorers, so_far.committed, so_far.states
        totals = {stack: [0.0, 0] for stack in scorers}
        first = next(iter(scorers.values()))
        with first.context.timer("selection"):
            for b in range(first.runner.num_batches):
                for done, (stack, scorer) in enumerate(scorers.items()):
                    if self.config.score_at == "window":
                        terms = self._window_terms(scorer, states[stack], window, blocks[stack], b)
                    else:
                        modules = {**committed[stack], **blocks[stack]}
                        hidden = self._output_states(
                            scorer, stack, modules, states, window, resume, store_at, stored, b
                        )
                        terms = scorer.score_terms(hidden, b)
                    for term, count in terms:
                        totals[stack][0] += term
                        totals[stack][1] += count
                        if against is None:
                            continue
                        bound = self._loses(scorers, totals, window, against)
                        if bound is not None:
                            self._search["early_exits"] += len(scorers) * (first.runner.num_batches - b) - done
                            return None, None, bound
        by_stack = {stack: scorer.score_value(*totals[stack]) for stack, scorer in scorers.items()}
        return sum(by_stack.values()) / len(by_stack), by_stack, None

    def _output_states(
        self,
        scorer: WindowScorer,
        stack: str,
        modules: Mapping[int, nn.Module],
        states: Mapping[str, Sequence[Sequence[torch.Tensor]]],
        window: Window,
        resume: Resume,
        store_at: int | None,
        stored: Resume,
        batch: int,
    ) -> torch.Tensor:
        """One batch's final states (before the final norm) with `modules` in place, from the window's start or
        where `resume` left the batch; the state entering `store_at` is stored on the way."""
        begin, hidden = window[0], states[stack][window[0]][batch]
        resumed = resume.take(stack, window[0], batch)
        if resumed is not None:
            begin, hidden = resume.position, resumed
            self._search["resumed_batches"] += 1
        if store_at is not None and begin < store_at:
            hidden = scorer.run_batch(begin, store_at, modules, hidden, batch)
            stored.put(stack, window[0], batch, hidden)
            begin = store_at
        return scorer.run_batch(begin, len(scorer.layers), modules, hidden, batch)

    @staticmethod
    def _window_terms(
        scorer: WindowScorer,
        states: Sequence[Sequence[torch.Tensor]],
        window: Window,
        blocks: Mapping[int, nn.Module],
        batch: int,
    ) -> list[tuple[float, int]]:
        """`score_at="window"`: one batch's ``(sum, count)`` of masked token cosines between the window's output
        with its MLPs merged and the current stack's output there, both from the current stack's state entering the
        window (committed windows upstream included; none lies inside a candidate)."""
        stop = window[-1] + 1
        hidden = scorer.run_batch(window[0], stop, blocks, states[window[0]][batch], batch)
        cos = cosine_rows(hidden, states[stop][batch], scorer.masks[batch], "all")
        return [(float(cos.sum()), cos.numel())]

    @staticmethod
    def _loses(
        scorers: Mapping[str, WindowScorer],
        totals: Mapping[str, list],
        window: Window,
        against: tuple[Window, float],
    ) -> float | None:
        """The bound of a candidate's score given its partial `totals`, when it can no longer be chosen over
        `against` (beaten, or at best equal and later in start order); else None."""
        if all(totals[stack][1] == scorer.score_count for stack, scorer in scorers.items()):
            return None  # complete: its score decides
        bounds = [scorer.score_bound(*totals[stack]) for stack, scorer in scorers.items()]
        bound = sum(bounds) / len(bounds)
        best, value = against
        scorer = next(iter(scorers.values()))
        if scorer.better(value, bound) or (bound == value and window[0] > best[0]):
            return bound
        return None

    @staticmethod
    def _states_with(
        scorer: WindowScorer, blocks: Mapping[int, nn.Module], states: Sequence[Sequence[torch.Tensor]], start: int
    ) -> list[Sequence[torch.Tensor]]:
        """The per-layer input states once `blocks` replace their layers, recomputed from `start` on."""
        updated = list(states[: start + 1])
        with scorer.context.timer("selection"):
            for position in range(start, len(scorer.layers)):
                updated.append(scorer.engine.run_layers([position], updated[-1], dict(blocks)))
        return updated

    @torch.no_grad()
    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        """Writes the merged MLPs (computed from the unmodified layers first) and ties each window's layers, in every
        merged stack."""
        if self._windows is None:
            raise RuntimeError("ffn_merge.apply_ needs the windows chosen by plan(); call plan() first.")
        if plan.group_lists() != [[i] for i in range(plan.num_layers)]:
            raise ValueError(f"ffn_merge keeps every layer, but got the plan {plan.describe()}.")
        for stack in self._scorers:
            for window in self._windows:
                check_same_layout(adapter, stack, window)
        merged = {
            stack: [merged_mlp(adapter, stack, w, self.config, scorer) for w in self._windows]
            for stack, scorer in self._scorers.items()
        }
        # What the stock format stores: every layer its own MLP (tied copies are written out in full), so this is
        # also what a plain from_pretrained has. Merging changes no shape, so it is counted before anything changes.
        in_file = parameter_footprint(adapter.model)
        shared = 0
        for stack, weights_list in merged.items():
            for window, weights in zip(self._windows, weights_list, strict=True):
                for i in window if not self.config.tie else window[:1]:
                    write_mlp_(adapter.block(stack, i).mlp, weights)
                if self.config.tie:
                    shared += tie_mlps_(adapter, stack, window)
        in_memory = parameter_footprint(adapter.model)
        context.report["ffn_parameters_shared"] = shared
        context.report["ffn_parameters_in_file"], context.report["ffn_bytes_in_file"] = in_file
        context.report["ffn_parameters_in_memory"], context.report["ffn_bytes_in_memory"] = in_memory
        self._scorers = {}  # frees the cached calibration states


__all__ = [
    "FfnMergeConfig",
    "FfnMergeMethod",
    "WindowScorer",
    "check_windows_fit",
    "merged_mlp",
    "parameter_footprint",
    "retie_ffn_",
]
