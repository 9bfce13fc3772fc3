"""The calibrated-states engine: the residual stream at every layer boundary of one stack, computed once.

Selection methods compare states at layer boundaries (ShortGPT: each layer's input and output; UIDL/ReplaceMe: the
input of a block and the output n layers later) or score a shortened stack by its next-token loss (SLEB, the
search of ``auto``). All of them need the same thing: the hidden states entering layer i of the *original* stack,
for every i, on the calibration batches. `CalibratedStates` computes them layer by layer through the
`LayerwiseRunner` (so offloaded models work: one layer on the compute device at a time) and keeps them, so that a
method pays one stack pass for all its comparisons and a candidate suffix run starts from a cached prefix.

Memory: every boundary kept is ``tokens x hidden`` in the model's dtype (SmolLM2 at 32 x 512 tokens: 38 MB a
boundary in float32, 1.2 GB for all 31); `keep` limits which boundaries stay cached when that is too much.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..options.hints import check_scoring_batches
from ..utils.torch_utils import count_parameters, first_output, module_device
from .capture import LayerwiseRunner, _to_device
from .distributed import all_reduce_sums
from .model_access import CalibrationAdapter

TokenChoice = Literal["last", "all"]

#: A lower bound, per token pair, of the next-token NLL as `next_token_nll` computes it. Mathematically the NLL is
#: nonnegative; in floating point the log-softmax at the largest logit is ``(x - max) - log(sum)`` with ``sum >= 1``
#: up to the exp's rounding, so it can go below zero by a few units in the last place of float32 (about 1e-7). A
#: search that stops scoring a candidate once its partial sum already loses (SLEB's early exit) bounds what the
#: pairs it has not scored can still subtract by this floor: a hundred times the room that rounding needs.
NLL_PAIR_FLOOR = -1e-5

#: An upper bound, per token, of the cosine `cosine_rows` computes: 1, plus room for the few units in the last place
#: of float64 by which a rounded cosine of two nearly parallel vectors can exceed it (a search bounding the score a
#: candidate can still reach counts the tokens it has not scored at this).
COSINE_TOKEN_CEILING = 1.0 + 1e-6


class CalibratedStates:
    """Hidden states at the layer boundaries of one stack, computed lazily and cached.

    ``boundary(i)`` is the list (one tensor per calibration batch) of states entering layer ``i``; ``boundary(L)``
    is the output of the last layer, before the final norm.

    Args:
        runner: A runner positioned at the input of layer 0 (its cached call arguments are reused for every run).
        layers: The stack's layers, in order (the original ones, before any change).
        keep: Boundaries to keep cached once computed (None: all). Others are recomputed from the nearest cached
            boundary below when asked for again.
    """

    def __init__(self, runner: LayerwiseRunner, layers: Sequence[torch.nn.Module], keep: Iterable[int] | None = None):
        self.runner = runner
        self.layers = list(layers)
        self.keep = None if keep is None else set(keep) | {0}
        self._cache: dict[int, list[torch.Tensor]] = {0: runner.inputs}
        #: The calibration batches the states were computed from (token ids for `next_token_nll`), when known.
        self.batches: list[Any] | None = None

    @classmethod
    def on_first_batches(
        cls,
        runner: LayerwiseRunner,
        layers: Sequence[torch.nn.Module],
        batches: Sequence[Any],
        num_batches: int | None = None,
        keep: Iterable[int] | None = None,
    ) -> CalibratedStates:
        """The engine over the first `num_batches` calibration batches only (None: all of them).

        A search method scores many candidates, each through every layer above its change, so its cost scales with
        the batches it scores on; ``scoring_batches`` trades that cost against noise. The runner is cut down in
        place (its inputs and masks), so every run, mask and the NLL's token ids see the same batches.
        """
        check_scoring_batches(num_batches)
        if num_batches is not None:
            runner.inputs = runner.inputs[:num_batches]
            runner.masks = runner.masks[:num_batches]
        states = cls(runner, layers, keep)
        states.batches = list(batches)[: runner.num_batches]
        return states

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def masks(self) -> list[torch.Tensor]:
        return self.runner.masks

    @property
    def num_batches(self) -> int:
        return self.runner.num_batches

    def boundary(self, index: int) -> list[torch.Tensor]:
        """States entering layer `index` of the original stack (``index == num_layers``: the stack's output)."""
        if not 0 <= index <= self.num_layers:
            raise IndexError(f"boundary {index} does not exist in a stack of {self.num_layers} layers.")
        if 0 not in self._cache:  # released by `release_layer_zero`: the runner records them again
            self._cache[0] = self.runner.inputs
        if index in self._cache:
            return self._cache[index]
        start = max(i for i in self._cache if i <= index)
        current = self._cache[start]
        for i in range(start, index):
            current = self.runner.run(self.layers[i], i, current)
            if self.keep is None or i + 1 in self.keep:
                self._cache[i + 1] = current
        return current

    def release_layer_zero(self) -> None:
        """Drops the layer-0 states (the runner's and this cache's reference): a walk past layer 0 that needs them
        no more saves a copy of the calibration states for the rest of it. Whoever asks for boundary 0 (or the
        runner's inputs) later gets them recorded again, the same tensors bit for bit."""
        self._cache.pop(0, None)
        self.runner.release_inputs()

    def all_boundaries(self, on_layer: Callable[[int], None] | None = None) -> list[list[torch.Tensor]]:
        """Every boundary 0..L in one pass (cached as `keep` allows); `on_layer(i)` is called after layer i runs."""
        result = [self.boundary(0)]
        for i in range(self.num_layers):
            result.append(self.boundary(i + 1))
            if on_layer is not None:
                on_layer(i)
        return result

    def walk(self) -> Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        """Yields ``(i, input of layer i, output of layer i)`` for every layer in one pass, caching as `keep` allows.

        Only two boundaries are alive at a time unless cached, so a whole-stack scan (ShortGPT's Block Influence)
        costs one stack pass and two boundaries of memory.
        """
        current = self.boundary(0)
        for i in range(self.num_layers):
            nxt = self._cache.get(i + 1)
            if nxt is None:
                nxt = self.runner.run(self.layers[i], i, current)
                if self.keep is None or i + 1 in self.keep:
                    self._cache[i + 1] = nxt
            yield i, current, nxt
            current = nxt

    def run_layers(
        self, indices: Sequence[int], inputs: Sequence[torch.Tensor], modules: dict[int, torch.nn.Module] | None = None
    ) -> list[torch.Tensor]:
        """Runs the original layers `indices` in order on `inputs` (a layer may be swapped through `modules`)."""
        current = list(inputs)
        for i in indices:
            module = (modules or {}).get(i, self.layers[i])
            current = self.runner.run(module, i, current)
        return current

    @torch.no_grad()
    def run_layers_on_batch(
        self,
        indices: Sequence[int],
        hidden: torch.Tensor,
        batch: int,
        modules: dict[int, torch.nn.Module] | None = None,
    ) -> torch.Tensor:
        """`run_layers` on one calibration batch: the original layers `indices` in order on `hidden`, batch `batch`.

        Op for op what `LayerwiseRunner.run` does for that batch (same call arguments, same device moves), so the
        result is the same tensor, bit for bit, as the batch's entry of `run_layers`: a search can score a candidate
        batch by batch and stop early without changing any number it does compute. The work is counted on the runner
        as its own runs are.
        """
        runner = self.runner
        for i in indices:
            module = (modules or {}).get(i, self.layers[i])
            device = module_device(module)
            runner.work += count_parameters(module) * hidden.shape[0] * hidden.shape[1]
            kwargs = _to_device(runner.layer_kwargs[i][batch], device)
            hidden = first_output(module(hidden.to(device), **kwargs)).to(hidden.device)
        return hidden

    def mean_cosine(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], tokens: TokenChoice = "all") -> float:
        """Mean cosine similarity between two state lists over real tokens (or each row's last real token)."""
        total, count = 0.0, 0
        for x, y, mask in zip(a, b, self.masks, strict=True):
            cos = cosine_rows(x, y, mask, tokens)
            total, count = total + float(cos.sum()), count + cos.numel()
        total, count = all_reduce_sums(total, count)  # over the ranks' shares (calibration/distributed.py)
        if count == 0:
            raise ValueError("no calibration token is unmasked: cannot compare states.")
        return total / count

    def next_token_nll(
        self,
        adapter: CalibrationAdapter,
        final: Sequence[torch.Tensor],
        stack: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> float:
        """`next_token_nll` of final-layer states on the engine's own batches (row-bounded; see the function)."""
        if self.batches is None:
            raise ValueError(
                "these states were built without their calibration batches (no token ids to score); build them "
                "with CalibratedStates.on_first_batches."
            )
        return next_token_nll(adapter, final, self.batches, stack, dtype)

    def mean_angular_distance(
        self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], tokens: TokenChoice = "last"
    ) -> float:
        """Mean of arccos(cos(a_t, b_t)) / π over the chosen tokens (Gromov et al.'s block distance, in [0, 1])."""
        return mean_angle(a, b, self.masks, tokens)


def chosen_rows(x: torch.Tensor, mask: torch.Tensor | None, tokens: TokenChoice) -> torch.Tensor:
    """The (positions, hidden) states at the chosen positions of (batch, seq, hidden) states, padding excluded, in
    their own dtype and device.

    ``tokens="last"`` takes each row's last real token (the one that has seen the whole sequence, as UIDL measures);
    ``"all"`` every real token. A walk that compares boundaries several layers apart keeps only these rows of each
    (`methods.uidl.block_distances`): with ``"last"``, one row a sequence instead of the whole boundary.
    """
    if tokens not in ("last", "all"):
        raise ValueError(f"tokens must be 'last' or 'all', got {tokens!r}.")
    valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.to(x.device).bool()
    if tokens == "last":
        lengths = valid.sum(dim=1)
        rows = torch.nonzero(lengths > 0).flatten()
        # Last real position of each row: the highest index whose mask is 1 (right or left padding alike).
        positions = torch.arange(valid.shape[1], device=x.device).expand_as(valid)
        last = torch.where(valid, positions, -1).amax(dim=1)[rows]
        return x[rows, last]
    return x[valid]


def cosine_rows(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None, tokens: TokenChoice) -> torch.Tensor:
    """float64 cosines of the chosen positions (`chosen_rows`) of (batch, seq, hidden) states, padding excluded."""
    return row_cosines(chosen_rows(a, mask, tokens), chosen_rows(b.to(a.device), mask, tokens))


def row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 cosines of matching rows of two (positions, hidden) tensors (`chosen_rows`)."""
    return torch.nn.functional.cosine_similarity(a.double(), b.to(a.device).double(), dim=-1, eps=1e-12)


@torch.no_grad()
def next_token_nll(
    adapter: CalibrationAdapter,
    states: Sequence[torch.Tensor],
    batches: Sequence[Any],
    stack: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Mean next-token NLL of final-layer `states` (before the final norm) over pairs of real tokens.

    One row at a time through the final norm and the LM head, so the logits never exceed (seq, vocab): with a
    150k vocabulary a whole batch of them would dwarf the model. The log-softmax runs in `dtype` (float32, or
    float64 for a method that compares candidates whose losses differ in the later digits, as ffn_merge does),
    over the contiguous vocabulary axis, which is also about twice as fast as over a transposed batch.

    The sum is the one of `next_token_nll_terms` taken in batch and row order, so a search adding those terms itself
    (and stopping early) gets this function's value exactly for the candidates it completes.
    """
    total, count = 0.0, 0
    for hidden, batch in zip(states, batches, strict=True):
        for nll, pairs in next_token_nll_terms(adapter, hidden, batch, stack, dtype):
            total += nll
            count += pairs
    if count == 0:
        raise ValueError("no pair of real tokens in the calibration batches: cannot score a next-token loss.")
    return total / count


@torch.no_grad()
def next_token_nll_terms(
    adapter: CalibrationAdapter,
    hidden: torch.Tensor,
    batch: Any,
    stack: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[float, int]]:
    """Per row of one batch's final-layer states, ``(summed NLL of its real pairs, number of those pairs)``.

    Lazy: a row's logits are computed when its term is asked for, so a search that stops after a row (an early exit
    of a hopeless candidate) never pays the LM head for the others. These are exactly the terms `next_token_nll`
    adds, in its order.
    """
    norm, head = adapter.final_norm(stack) or torch.nn.Identity(), adapter.lm_head(stack)
    mask = batch.attention_mask.to(hidden.device).bool()
    targets = batch.input_ids.to(hidden.device)
    for row in range(hidden.shape[0]):
        logits = head(norm(hidden[row : row + 1]))[0, :-1].to(dtype)
        valid = mask[row, :-1] & mask[row, 1:]
        nll = torch.nn.functional.cross_entropy(logits[valid], targets[row, 1:][valid], reduction="sum")
        yield float(nll), int(valid.sum())


def next_token_pairs(batches: Sequence[Any]) -> int:
    """The number of pairs of real tokens `next_token_nll` averages over on `batches` (the same for every candidate)."""
    count = 0
    for batch in batches:
        mask = batch.attention_mask.bool()
        count += int((mask[:, :-1] & mask[:, 1:]).sum())
    return count


def mean_angle(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor | None],
    tokens: TokenChoice = "all",
) -> float:
    """Mean arccos(cos(a_t, b_t)) / π over the chosen real tokens of per-batch states (padding excluded), in [0, 1].

    A function as well as the engine's method, for states a search holds on only some of the batches.
    """
    return _mean_angle_of(cosine_rows(x, y, mask, tokens) for x, y, mask in zip(a, b, masks, strict=True))


def mean_angle_of_rows(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """`mean_angle` of states already reduced to their chosen rows (`chosen_rows`), batch by batch: the same sums in
    the same order, so the same float, from a fraction of the memory."""
    return _mean_angle_of(row_cosines(x, y) for x, y in zip(a, b, strict=True))


def _mean_angle_of(cosines: Iterable[torch.Tensor]) -> float:
    """Mean arccos / π of per-batch cosines, summed over the batches in order and then over the ranks."""
    total, count = 0.0, 0
    for cos in cosines:
        cos = cos.clamp(-1.0, 1.0)
        total, count = total + float(torch.arccos(cos).sum() / math.pi), count + cos.numel()
    total, count = all_reduce_sums(total, count)  # over the ranks' shares (calibration/distributed.py)
    if count == 0:
        raise ValueError("no calibration token is unmasked: cannot compare states.")
    return total / count


@dataclass
class HeldBlock:
    """The whole boundaries around the best block of a selection walk that held them
    (`methods.uidl.walk_block_distances` with ``hold=True``): per calibration batch, the state entering the layer
    before the block (``before``, layer ``start − 1``'s input) and the state leaving the block (``after``, the
    input of layer ``start + size``). A fit of that layer towards the block's output (ReplaceMe's map) reads them
    instead of walking the dense stack again."""

    start: int
    size: int
    before: list[torch.Tensor]
    after: list[torch.Tensor]
