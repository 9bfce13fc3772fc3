"""How ffn_merge scores a candidate window on the calibration text, and the averaged MLP a window gets.

`WindowScorer` caches each stack's calibration states once and scores a candidate by running the stack from the
window's first layer with the merged MLPs in place (cosine of the final states to the original model's, or the
next-token NLL), with an early exit once a candidate cannot beat the best so far; it also holds the activation
correlations the "permute" alignment needs. `merged_mlp` averages a window's (aligned) MLPs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import capture_module_inputs
from ...calibration.states import (
    COSINE_TOKEN_CEILING,
    NLL_PAIR_FLOOR,
    CalibratedStates,
    cosine_rows,
    next_token_nll_terms,
    next_token_pairs,
)
from ...compression.method import MethodContext
from ...ops.ffn_alignment import (
    alignment_permutation,
    alignment_signals,
    average_mlps,
    correlation_from_sums,
    correlation_sums,
    num_alignment_signals,
    permute_mlp_units,
)
from ...options.methods.ffn_merge import FfnMergeConfig
from ...utils.torch_utils import count_parameters
from .tying import Window, read_mlp

logger = logging.getLogger(__name__)


class WindowScorer:
    """Cached calibration states of the original model, and the scoring of merged candidates on them.

    One pass stores the input of every layer (``states``) and of every MLP (``mlp_inputs``), so alignment needs
    no forward at all and a candidate window starting at s is run from the cached state at s: the prefix is never
    recomputed. Memory: about 2 (L + 1) copies of the calibration hidden states.

    The states, the suffix runs, the cosine and the next-token loss are the states engine's (`engine`); the scorer
    adds the MLP inputs and the alignments.
    """

    def __init__(self, adapter: ArchitectureAdapter, context: MethodContext, config: FfnMergeConfig) -> None:
        self.adapter = adapter
        self.context = context
        self.config = config
        self.stack = context.stack
        # Alignment and scoring on the first `scoring_batches` batches only.
        self.engine = CalibratedStates.on_first_batches(
            context.new_runner(adapter), adapter.layers(self.stack), context.batches, config.scoring_batches
        )
        self.runner = self.engine.runner
        self.masks = self.engine.masks
        self.batches = self.engine.batches
        head = adapter.lm_head(self.stack) if config.selection == "nll" else None
        self._head_weights = 0 if head is None else count_parameters(head)
        self.layers = self.engine.layers
        self.states, self.mlp_inputs = self._capture()
        #: Final hidden states (after the final norm) of the original model, the reference for "cosine".
        self.reference = self.finish(self.states[-1])
        self._permutations: dict[tuple[int, int], torch.Tensor] = {}

    def _capture(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        states, mlp_inputs = [self.engine.boundary(0)], []
        num_layers = len(self.layers)
        with self.context.timer("selection"), self.context.progress_bar(num_layers, "ffn capture") as bar:
            for i in range(num_layers):
                captured: list[torch.Tensor] = []
                # The engine caches every boundary, so boundary i + 1 runs layer i once, here, under the capture.
                with capture_module_inputs(self.adapter.block(self.stack, i).mlp.up.module, captured.append):
                    states.append(self.engine.boundary(i + 1))
                if len(captured) != self.runner.num_batches:
                    raise RuntimeError(
                        f"layer {i}'s MLP was called {len(captured)} times for {self.runner.num_batches} batches; "
                        "ffn_merge expects one MLP call per layer call."
                    )
                mlp_inputs.append(captured)
                bar.set_description(f"block {i + 1}/{num_layers}: ffn capture")
                bar.update()
        return states, mlp_inputs

    # ---------------------------------------------------------------- alignment
    def _tokens(self, layer: int, batch: int) -> torch.Tensor:
        x = self.mlp_inputs[layer][batch]
        mask = self.masks[batch].reshape(-1).to(x.device).bool()
        return x.reshape(-1, x.shape[-1])[mask]

    def correlation(self, anchor: int, member: int) -> torch.Tensor:
        """(units, units) correlation between the anchor's and the member's units, averaged over the signals."""
        return self.correlations(anchor, [member])[member]

    def correlations(self, anchor: int, members: Sequence[int]) -> dict[int, torch.Tensor]:
        """The correlation of every member's units with the anchor's, from one pass over the calibration batches.

        Per batch, each layer's signals (gate and up pre-activations of a gated MLP) are computed once, and the
        anchor's are shared by all members: a window of k layers costs k signal computations a batch, not
        4 (k - 1) as pair by pair, one signal at a time. The sums are accumulated per signal in batch order and
        averaged over the signals in signal order, exactly as the pairwise computation does, so the result is the
        same to the last bit. Memory: per member, one (units x units) float64 sum per signal.
        """
        views = {i: self.adapter.block(self.stack, i).mlp for i in (anchor, *members)}
        weights = {i: read_mlp(v) for i, v in views.items()}
        signal = self.config.alignment_signal
        num_signals = num_alignment_signals(weights[anchor], signal)
        sums: dict[int, list[Any]] = {m: [None] * num_signals for m in members}
        for b in range(len(self.masks)):
            reference = alignment_signals(self._tokens(anchor, b), weights[anchor], signal, views[anchor].activation)
            for member in members:
                signals = alignment_signals(self._tokens(member, b), weights[member], signal, views[member].activation)
                for s in range(num_signals):
                    batch = correlation_sums(reference[s], signals[s])
                    sums[member][s] = batch if sums[member][s] is None else sums[member][s] + batch
                del signals
            del reference
        result = {}
        for member in members:
            total = None
            for s in range(num_signals):
                corr = correlation_from_sums(sums[member][s])
                total = corr if total is None else total + corr
            sums[member] = []  # frees the float64 sums before the next member's correlation is built
            result[member] = total / num_signals
        return result

    def prepare_permutations(self, anchor: int, members: Sequence[int]) -> None:
        """Computes the alignments of `members` to `anchor` that are not memoised yet, in one pass (see
        `correlations`)."""
        missing = [m for m in members if m != anchor and (anchor, m) not in self._permutations]
        if not missing:
            return
        with self.context.timer("alignment"):
            for member, corr in self.correlations(anchor, missing).items():
                self._permutations[(anchor, member)] = alignment_permutation(corr)

    def permutation(self, anchor: int, member: int) -> torch.Tensor:
        """The alignment of `member`'s units to `anchor`'s (memoised: greedy rounds revisit the same pairs)."""
        self.prepare_permutations(anchor, [member])
        return self._permutations[(anchor, member)]

    # ------------------------------------------------------------------ scoring
    def finish(self, states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = self.adapter.final_norm(self.stack)
        return [norm(h) if norm is not None else h for h in states]

    def score(self, final: Sequence[torch.Tensor]) -> float:
        """The selection criterion of a candidate's final hidden states (before the final norm)."""
        if self.config.selection == "cosine":
            return self.engine.mean_cosine(self.finish(final), self.reference, tokens="all")
        # One row at a time (the logits of a whole batch, (batch, seq, vocab) in float64, were gigabytes and the
        # log-softmax over a transposed batch half as fast); float64 as before, so close candidates stay apart.
        self.context.extra_work += self._head_weights * sum(int(h.shape[0] * h.shape[1]) for h in final)
        return self.engine.next_token_nll(self.adapter, final, self.stack, dtype=torch.float64)

    def better(self, a: float, b: float) -> bool:
        """Whether score `a` beats score `b` (ties keep the earlier candidate)."""
        return a > b if self.config.selection == "cosine" else a < b

    def run_from(self, start: int, blocks: Mapping[int, nn.Module], states: Sequence[Sequence[torch.Tensor]]):
        """Final states (before the final norm) when layers in `blocks` are replaced, from cached `states[start]`."""
        with self.context.timer("selection"):
            return self.engine.run_layers(range(start, len(self.layers)), states[start], dict(blocks))

    # -------------------------------------------------------------- batch by batch (the search's own path)
    @functools.cached_property
    def score_count(self) -> int:
        """What `score` averages over: real tokens ("cosine") or pairs of real tokens ("nll"), on every batch."""
        if self.config.selection == "nll":
            return next_token_pairs(self.batches)
        return sum(
            int(h.shape[0] * h.shape[1]) if m is None else int(m.bool().sum())
            for h, m in zip(self.reference, self.masks, strict=True)
        )

    def score_terms(self, hidden: torch.Tensor, batch: int) -> Iterator[tuple[float, int]]:
        """The terms `score` adds for one batch's final states, in its order: ``(sum, count)`` of the batch's token
        cosines, or of each row's next-token losses (lazily, so a search that stops skips the later rows' LM head).

        Summed from 0.0 in batch order and divided by the summed count, they give `score` to the last bit.
        """
        if self.config.selection == "cosine":
            cos = cosine_rows(self.finish([hidden])[0], self.reference[batch], self.masks[batch], "all")
            yield float(cos.sum()), cos.numel()
            return
        for term in next_token_nll_terms(self.adapter, hidden, self.batches[batch], self.stack, torch.float64):
            self.context.extra_work += self._head_weights * hidden.shape[1]
            yield term

    def score_value(self, total: float, count: int) -> float:
        """`score` from the summed terms (the same division, and the same refusal when nothing was scored)."""
        if count == 0:
            if self.config.selection == "cosine":
                raise ValueError("no calibration token is unmasked: cannot compare states.")
            raise ValueError("no pair of real tokens in the calibration batches: cannot score a next-token loss.")
        return total / count

    def score_bound(self, total: float, count: int) -> float:
        """The best score a candidate can still reach after terms summing to `total` over `count` of the
        `score_count` tokens or pairs: the rest counted at cosine 1 ("cosine", to `COSINE_TOKEN_CEILING`) or at
        loss 0 ("nll", to `NLL_PAIR_FLOOR`). Rounding is monotone, so the score it ends with is never better."""
        remaining = self.score_count - count
        per_item = COSINE_TOKEN_CEILING if self.config.selection == "cosine" else NLL_PAIR_FLOOR
        return (total + per_item * remaining) / self.score_count

    def run_batch(
        self, first: int, stop: int, blocks: Mapping[int, nn.Module], hidden: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """Layers ``first .. stop - 1`` (those in `blocks` replaced) on one batch's states: bit for bit that batch's
        entry of the same `run_from` over every batch."""
        return self.engine.run_layers_on_batch(range(first, stop), hidden, batch, dict(blocks))


class Resume:
    """Candidates' states entering one layer (``position``), per stack, window start and batch: left by a round for
    the candidates below its winner, taken by the next round, which has that window merged from there on."""

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self._states: dict[tuple[str, int, int], torch.Tensor] = {}

    def put(self, stack: str, start: int, batch: int, state: torch.Tensor) -> None:
        self._states[(stack, start, batch)] = state

    def take(self, stack: str, start: int, batch: int) -> torch.Tensor | None:
        """The stored state (handed over once: the holder lets go of it), or None."""
        return self._states.pop((stack, start, batch), None)


def merged_mlp(
    adapter: ArchitectureAdapter, stack: str, window: Window, config: FfnMergeConfig, scorer: WindowScorer | None
):
    """The averaged MLP of `window` (non-anchor members aligned first for the "permute" variant)."""
    anchor = config.anchor_of(window)
    if config.variant == "permute":
        scorer.prepare_permutations(anchor, window)
    members = []
    for i in window:
        weights = read_mlp(adapter.block(stack, i).mlp)
        if config.variant == "permute" and i != anchor:
            weights = permute_mlp_units(weights, scorer.permutation(anchor, i))
        members.append(weights)
    return average_mlps(members)
