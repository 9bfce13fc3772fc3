"""SLEB (Song et al., 2024, "SLEB: Streamlining LLMs through Redundancy Verification and Elimination of Blocks").

Iterative: at each step remove the single layer whose removal raises the calibration negative log-likelihood
the least (ties: the lowest layer index), then re-score the shortened model.

The search computes exactly what scoring every candidate on every calibration batch computes (the same plan and
the same recorded NLLs, bit for bit), and skips only work that cannot change them:

- a candidate removal at position p re-runs only the layers above p, from the cached state entering p;
- the states entering every kept layer are computed once; after a removal at position w, those below w are
  unchanged and only those above are recomputed;
- a candidate is scored batch by batch and LM-head row by row, and stops as soon as its partial NLL sum already
  loses to the best complete one: the terms still missing are nonnegative (to `NLL_PAIR_FLOOR`), so the partial
  sum bounds the total from below, and ties are decided by the layer index exactly as before;
- each candidate below the current best removal keeps its state entering that layer (optional: up to one more
  copy of the states); when that layer is the one removed, the next step resumes those candidates from there
  instead of re-running the layers between (the same layers on the same inputs: the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import (
    NLL_PAIR_FLOOR,
    CalibratedStates,
    next_token_nll,
    next_token_nll_terms,
    next_token_pairs,
)
from ..compression.method import CompressionMethod, MethodContext, apply_layer_drop_
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes
from ..options.methods.sleb import SLEBConfig
from ..plan import LayerPlan
from ..registry import register_method
from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import count_parameters

#: Kept under its old name: the row-bounded next-token loss now lives in the states engine.
calibration_nll = next_token_nll


class _FloorViolated(Exception):
    """A row's NLL fell below `NLL_PAIR_FLOOR` per pair: the early exit's bound does not hold for this model."""


@dataclass
class _Outcome:
    """How far one candidate was scored: its partial NLL sum over `pairs` token pairs, and whether it is complete."""

    partial: float
    pairs: int
    complete: bool
    #: Candidate-batches not scored in full (the batch it stopped in, and those after it).
    cut: int = 0


@dataclass
class _StepResult:
    removed: int
    nll: float
    #: Candidates stopped early in this step.
    candidates_cut: int
    #: Candidate-batches not scored in full in this step.
    batches_cut: int


@dataclass
class _Search:
    """The current stack's states and the scoring of candidate removals on them, across SLEB's steps.

    ``bounds[p]`` holds the states entering kept position p (``bounds[len(kept)]``: the stack's output), one tensor
    per scored batch. ``resume[(layer, b)]`` is candidate `layer`'s state (batch b) entering position
    ``resume_position``, left by the previous step for the candidates below the layer it removed.
    """

    adapter: ArchitectureAdapter
    context: MethodContext
    states: CalibratedStates
    protected: set[int]
    kept: list[int]
    bounds: list[list[torch.Tensor]]
    head_weights: int
    pairs: int
    prune: bool = True
    #: The scores of the candidates the last step completed (the others lost before their last pair).
    scores: dict[int, float] = field(default_factory=dict)
    resume: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    resume_position: int = 0
    early_exits: int = 0
    resumed_batches: int = 0

    @classmethod
    def start(
        cls, adapter: ArchitectureAdapter, context: MethodContext, states: CalibratedStates, protected: set[int]
    ) -> _Search:
        """The search on the full stack: one pass for the states entering every layer."""
        pairs = next_token_pairs(states.batches)
        if pairs == 0:
            raise ValueError("no pair of real tokens in the calibration batches: cannot score a next-token loss.")
        bounds = [states.boundary(0)]
        for index in range(states.num_layers):
            bounds.append(states.run_layers([index], bounds[-1]))
        return cls(
            adapter=adapter,
            context=context,
            states=states,
            protected=protected,
            kept=list(range(states.num_layers)),
            bounds=bounds,
            head_weights=count_parameters(adapter.lm_head(context.stack)),
            pairs=pairs,
        )

    # ------------------------------------------------------------------------------------------------ one step
    def step(self, keep_resume_states: bool, last: bool = False) -> _StepResult:
        """Removes the layer whose removal gives the lowest NLL (ties: lowest index) and updates the states (not
        after the `last` step: nothing reads them).

        Should a row's NLL break the early exit's bound, the step is scored again without early exits (and so are
        the later steps).
        """
        candidates = [index for index in self.kept if index not in self.protected]
        try:
            result, stored = self._score_all(candidates, keep_resume_states)
        except _FloorViolated:
            self.prune = False
            result, stored = self._score_all(candidates, keep_resume_states)
        if last:
            self.kept.remove(result.removed)
        else:
            self._remove(result.removed, stored)
        return result

    def _score_all(
        self, candidates: list[int], keep_resume_states: bool
    ) -> tuple[_StepResult, dict[tuple[int, int], torch.Tensor]]:
        """Scores the candidates against the best complete one; returns the winner and the states the candidates
        below it left for the next step.

        Top layer first. A candidate below the best so far stores its state entering the best's layer; a new best
        makes those of no use and they are dropped. Every candidate below the final winner is scored after it has
        become the best, so all of them leave their state for the next step. The expensive candidates (low layers,
        long suffixes) come last, when the best is as good as it gets and their early exits come soonest.
        """
        position = {index: p for p, index in enumerate(self.kept)}
        best: tuple[float, int] | None = None
        stored: dict[tuple[int, int], torch.Tensor] = {}
        self.scores = {}
        candidates_cut = batches_cut = 0
        for index in sorted(candidates, key=position.__getitem__, reverse=True):
            store_at = position[best[1]] if keep_resume_states and best is not None else None
            if store_at is not None and store_at <= position[index] + 1:
                store_at = None  # only above the candidate's first run layer is there anything to skip
            outcome = self._score(index, position[index], best, store_at, stored)
            if not outcome.complete:
                candidates_cut, batches_cut = candidates_cut + 1, batches_cut + outcome.cut
                continue
            score = outcome.partial / self.pairs
            self.scores[index] = score
            if best is None or (score, index) < best:
                best, stored = (score, index), {}  # the states entering the old best's layer are of no use now
        assert best is not None  # the first candidate is always completed: there is nothing to stop it against
        self.early_exits += batches_cut
        return _StepResult(best[1], best[0], candidates_cut, batches_cut), stored

    def _score(
        self,
        index: int,
        position: int,
        best: tuple[float, int] | None,
        store_at: int | None,
        stored: dict[tuple[int, int], torch.Tensor],
    ) -> _Outcome:
        """Scores removing the layer at `position`, batch by batch and row by row, until it completes or loses.

        It loses once ``(lower bound of its mean NLL, index) > best``: the partial sum plus `NLL_PAIR_FLOOR` for
        every pair not scored yet bounds the total sum from below, and dividing by the same positive count keeps
        the order (also when rounded), so its final ``(score, index)`` would be greater than the best's as well.
        """
        partial, pairs = 0.0, 0
        num_batches = self.states.num_batches
        for b in range(num_batches):
            begin, hidden = position + 1, self.bounds[position][b]
            resumed = self.resume.pop((index, b), None)
            if resumed is not None:
                begin, hidden = self.resume_position, resumed
                self.resumed_batches += 1
            for p in range(begin, len(self.kept)):
                if p == store_at:
                    stored[(index, b)] = hidden
                hidden = self.states.run_layers_on_batch([self.kept[p]], hidden, b)
            for nll, n in next_token_nll_terms(self.adapter, hidden, self.states.batches[b], self.context.stack):
                self.context.extra_work += self.head_weights * hidden.shape[1]
                if nll < NLL_PAIR_FLOOR * n:
                    raise _FloorViolated
                partial, pairs = partial + nll, pairs + n
                if best is not None and self.prune and pairs < self.pairs:
                    lower = partial + NLL_PAIR_FLOOR * (self.pairs - pairs)
                    if (lower / self.pairs, index) > best:
                        return _Outcome(partial, pairs, complete=False, cut=num_batches - b)
        return _Outcome(partial, pairs, complete=True)

    def _remove(self, removed: int, stored: dict[tuple[int, int], torch.Tensor]) -> None:
        """Drops `removed` from the stack: the states below it stay, those above it are recomputed (the winner's
        own suffix run), and the states its lower candidates stored become the next step's resume points."""
        position = self.kept.index(removed)
        self.kept.remove(removed)
        del self.bounds[position + 1 :]  # freed before the new ones are computed: never two copies
        for p in range(position, len(self.kept)):
            self.bounds.append(self.states.run_layers([self.kept[p]], self.bounds[-1]))
        # Every stored state enters the removed layer's position from below: the first layer above it now sits there.
        self.resume, self.resume_position = stored, position


@register_method("sleb")
class SLEBMethod(CompressionMethod):
    config_class = SLEBConfig
    requires_calibration = True
    required_capabilities = frozenset({"layer_drop"})
    config: SLEBConfig

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """SLEB: the states entering every kept layer, and each candidate's suffix run batch by batch from them.

        - selection: the runner (S, all batches) and the L states the search keeps on the scored batches (fraction f of
          S each: `scoring_batches`), the input of the layer a candidate's suffix runs and its outputs so far (one more
          copy and the run's), and the block temporaries or the next-token loss of one row
          (`next_token_nll`: the LM head's logits in float32, their valid rows and the log-softmax, 12·seqlen·V; a
          16-bit head output is freed once cast). With more than one step and `resume_candidates`, the candidates
          below the best removal keep their state entering it for the next step: up to L − 2 more states.
        Cost, a bound: at most what the exhaustive search spends, each step with L′ kept layers running L′ layers for
        the states, L′(L′ − 1)/2 for the suffixes and L′ LM heads. The search spends less: candidates stop once they
        lose, the states below a removal are kept, and candidates resume from their stored states.
        """
        s, L = z.shape, z.shape.num_layers
        scored = min(config.scoring_batches or z.cal.batches, z.cal.batches)
        fraction = min(1.0, scored * z.cal.batch_size / z.cal.nsamples)
        scored_states = int(z.S * fraction)
        nll = 12 * z.cal.seqlen * s.vocab_size
        forward = z.block_forward()
        selection = Phase(
            "selection",
            (
                z.tokens(),
                *z.runners(1),
                Term(
                    f"states entering every layer on the scored batches ({L})",
                    L * scored_states,
                    f"fraction {fraction:g}",
                ),
                Term(
                    "a candidate's suffix: the input of the layer run", scored_states, "the output of the layer before"
                ),
                Term(
                    "candidates' states entering the best removal, for the next step",
                    (L - 2) * scored_states if n > 1 and getattr(config, "resume_candidates", False) else 0,
                    "at most one per candidate below it (resume_candidates)",
                ),
                Term(
                    "largest per-batch work: a layer run, or one row's next-token loss",
                    max(int(z.run_outputs() * fraction) + forward, nll),
                    "run outputs + block temporaries, or logits (seqlen × V) with their float32 copies",
                ),
            ),
        )
        steps = range(L, L - n, -1)
        work = sum(k + k * (k - 1) / 2 + k * s.head_weights / s.layer_weights for k in steps)
        return [selection], fraction * work / L, True, []

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        """Refuses a stack no LM head reads, before calibration (and in `estimate`, which runs the same preflight)."""
        if adapter.lm_head(stack) is None:
            raise UnsupportedArchitectureError(
                f"method 'sleb' scores layer removals by the next-token negative log-likelihood of a causal LM head "
                f"reading the {stack!r} stack, and this {type(adapter.model).__name__} has none there "
                "(lm_head() is None). Methods that compare the stack's own states apply: shortgpt, laco, "
                "sliding_window (and flattengpt on pre-norm stacks)."
            )

    def _protected(self, num_layers: int) -> set[int]:
        protected = {0} if self.config.protect_first else set()
        if self.config.protect_last:
            protected.add(num_layers - 1)
        return protected

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        protected = self._protected(num_layers)
        if num_layers - len(protected) < num_to_remove:
            raise ValueError(
                f"with protected layers {sorted(protected)} only {num_layers - len(protected)} layers can be "
                f"removed, fewer than the {num_to_remove} requested."
            )

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        num_layers = adapter.num_layers(context.stack)
        self.check_target(num_layers, num_to_remove)
        protected = self._protected(num_layers)
        # Only the input of layer 0 is cached by the engine: the search keeps the states of its own current stack.
        states = CalibratedStates.on_first_batches(
            context.new_runner(adapter),
            adapter.layers(context.stack),
            context.batches,
            self.config.scoring_batches,
            keep=(),
        )
        steps = []
        with context.timer("selection"), context.progress_bar(num_to_remove, "sleb") as bar:
            search = _Search.start(adapter, context, states, protected)
            for step in range(num_to_remove):
                last = step == num_to_remove - 1
                result = search.step(self.config.resume_candidates and not last, last)
                steps.append(result)
                bar.set_description(f"step {step + 1}/{num_to_remove}: removed layer {result.removed}")
                bar.update()
        context.report["sleb_steps"] = [
            {"removed": r.removed, "nll": round(r.nll, 6), "candidates_cut": r.candidates_cut} for r in steps
        ]
        context.report["sleb_early_exits"] = search.early_exits
        context.report["sleb_resumed_batches"] = search.resumed_batches
        return LayerPlan.from_kept(num_layers, search.kept, stack=context.stack)

    def planning_batches(self) -> int | None:
        """The search reads the first `scoring_batches` batches only, and leaves nothing but its plan."""
        return self.config.scoring_batches

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        apply_layer_drop_(adapter, plan)
