"""UIDL (Gromov et al., 2024, "The Unreasonable Ineffectiveness of the Deeper Layers", arXiv 2403.17887).

Drop the contiguous block of n layers whose input and output are closest: the block starting at layer s minimises
the mean angular distance ``arccos(cos(x_s, x_{s+n})) / π`` over calibration sequences, where x_s enters layer s and
x_{s+n} leaves layer s+n-1 (the paper measures on each sequence's last token; ``tokens="all"`` averages every real
token). Several blocks (``num_blocks``) are taken greedily, smallest distance first, without overlap, each of
``num_layers_to_remove / num_blocks`` layers — the same selection ReplaceMe uses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.distributed import all_reduce_sums
from ..calibration.states import CalibratedStates, HeldBlock, chosen_rows, mean_angle_of_rows
from ..compression.method import CompressionMethod, MethodContext, apply_layer_drop_
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes, per_batch_term
from ..options.methods.uidl import BlockSelectionConfig
from ..plan import LayerPlan
from ..registry import register_method
from ..utils.errors import InvalidTargetError


def block_size(num_to_remove: int, num_blocks: int, num_layers: int, first_start: int) -> int:
    """Layers per block, checked: the blocks must divide the removal and fit in the stack without overlap."""
    if num_to_remove % num_blocks:
        raise InvalidTargetError(
            f"{num_to_remove} layers cannot be split into {num_blocks} equal blocks; choose num_blocks dividing "
            f"num_layers_to_remove (e.g. num_blocks=1)."
        )
    size = num_to_remove // num_blocks
    if num_blocks * size > num_layers - first_start:
        raise InvalidTargetError(
            f"{num_blocks} block(s) of {size} layers starting at layer {first_start} or later do not fit in a stack of "
            f"{num_layers}; remove fewer layers."
        )
    return size


def block_distances(states: CalibratedStates, size: int, tokens: str, first_start: int = 0) -> dict[int, float]:
    """`walk_block_distances` without holding any boundary whole."""
    return walk_block_distances(states, size, tokens, first_start)[0]


def walk_block_distances(
    states: CalibratedStates, size: int, tokens: str, first_start: int = 0, hold: bool = False
) -> tuple[dict[int, float], HeldBlock | None]:
    """Angular distance between the input of layer s and the output of layer s+size-1, for every start s.

    One stack pass; only the last `size` + 1 boundaries are kept, so memory does not grow with depth. With
    ``tokens="last"`` (the paper's, the default) each is kept as its last-token rows alone (`chosen_rows`: one row
    a sequence), so beside the runner's states only the boundaries entering and leaving the layer being run are
    whole: at LLaMA-2-7B with 7 layers removed, 2 of 128 × 2048 × 4096 bfloat16 states (4 GiB) instead of 9 (18 GiB).
    The distances are the same floats either way (`mean_angle_of_rows`).

    With ``tokens="last"`` and no holding, the walk releases the layer-0 states once layer 0 has run
    (`CalibratedStates.release_layer_zero`): from there on only the boundary entering the layer being run is
    whole, one copy of the states fewer (2 GiB at LLaMA-2-7B); a later reader (ReplaceMe's fit walk) has the
    runner record them again, an embedding pass.

    With ``hold=True`` the walk also keeps the last size + 2 boundaries whole, and for the best start so far (the
    smallest distance, ties to the lower start, as `choose_blocks` ranks them; starts from 1) the boundaries
    before and after it (`HeldBlock`, returned beside the distances): the window and the best pair, up to
    size + 4 whole boundaries at once. None when no start from 1 was measured.
    """
    masks = states.masks

    def kept(boundary: list[torch.Tensor]) -> list[torch.Tensor]:
        if tokens != "last":
            return boundary
        return [chosen_rows(x, mask, "last") for x, mask in zip(boundary, masks, strict=True)]

    window: deque[list[torch.Tensor]] = deque([kept(states.boundary(0))], maxlen=size + 1)
    whole: deque[list[torch.Tensor]] = deque([states.boundary(0)] if hold else [], maxlen=size + 2)
    distances: dict[int, float] = {}
    best: HeldBlock | None = None
    for i, before, after in states.walk():
        window.append(kept(after))
        if hold:
            whole.append(after)
        start = i + 1 - size
        if start >= first_start and len(window) == size + 1:
            if tokens == "last":
                distances[start] = mean_angle_of_rows(window[0], window[-1])
            else:  # the window holds the boundaries whole
                distances[start] = states.mean_angular_distance(window[0], window[-1], tokens=tokens)
            if hold and start >= 1 and (best is None or distances[start] < distances[best.start]):
                best = HeldBlock(start, size, whole[0], whole[-1])  # whole[0] enters layer start − 1
        del before, after  # while the next layer runs, only the walk's own two boundaries stay alive
        if i == 0 and tokens == "last" and not hold:
            states.release_layer_zero()  # the window keeps its last-token rows, copies of their own
    return distances, best


def holds_within(size: int, copy_bytes: float, budget: float) -> bool:
    """Whether a holding walk (`walk_block_distances`) fits `budget` bytes: its window of size + 2 whole boundaries
    and the best block's pair, size + 4 copies of the calibration states (`copy_bytes` each) at most."""
    return 0 < (size + 4) * copy_bytes <= budget


def choose_blocks(distances: dict[int, float], size: int, num_blocks: int) -> list[int]:
    """Starts of `num_blocks` non-overlapping blocks, greedily by smallest distance (ties: the lower start)."""
    chosen: list[int] = []
    for start in sorted(distances, key=lambda s: (distances[s], s)):
        if all(start + size <= c or c + size <= start for c in chosen):
            chosen.append(start)
            if len(chosen) == num_blocks:
                return sorted(chosen)
    raise InvalidTargetError(
        f"only {len(chosen)} non-overlapping blocks of {size} layers fit, {num_blocks} were asked; lower num_blocks."
    )


def select_blocks(
    adapter: ArchitectureAdapter,
    context: MethodContext,
    num_to_remove: int,
    config: BlockSelectionConfig,
    first_start: int,
) -> LayerPlan:
    """The plan dropping the chosen blocks; the distances go to the report."""
    return select_blocks_holding(adapter, context, num_to_remove, config, first_start)[0]


def select_blocks_holding(
    adapter: ArchitectureAdapter,
    context: MethodContext,
    num_to_remove: int,
    config: BlockSelectionConfig,
    first_start: int,
    hold_within: float = 0.0,
    walk_instead: Callable[[CalibratedStates, int], tuple[dict[int, float], Any]] | None = None,
) -> tuple[LayerPlan, Any]:
    """`select_blocks`, and the whole boundaries around the chosen block (`walk_block_distances`) when the walk's
    size + 4 copies of the calibration states fit `hold_within` bytes (every rank's share under a sharded
    calibration: the ranks decide alike).

    Otherwise, with `walk_instead` (``(states, size) -> (distances, kept)``), that walk measures the distances
    instead and what it keeps for its nearest start (an object with a ``start``, such as ReplaceMe's
    `FilledBridge`) is returned in place of the held boundaries. Either is None when more than one block is chosen:
    only the nearest start's is kept."""
    num_layers = adapter.num_layers(context.stack)
    size = block_size(num_to_remove, config.num_blocks, num_layers, first_start)
    states = context.new_states(adapter, keep=())
    hold = False
    if hold_within > 0:  # the same on every rank: `hold_within` is the config's
        (copy_bytes,) = all_reduce_sums(sum(h.numel() * h.element_size() for h in states.runner.inputs))
        hold = context.report["held_states"] = holds_within(size, copy_bytes, hold_within)
    with context.timer("selection"):
        if walk_instead is not None and not hold:
            distances, held = walk_instead(states, size)
        else:
            distances, held = walk_block_distances(states, size, config.tokens, first_start, hold)
        starts = choose_blocks(distances, size, config.num_blocks)
    if held is not None and starts != [held.start]:  # more than one block: the walk kept the best start's only
        held = None
    removed = {s + j for s in starts for j in range(size)}
    context.report["block_distances"] = {str(s): round(d, 6) for s, d in distances.items()}
    context.report["blocks"] = [[s, s + size] for s in starts]
    plan = LayerPlan.from_kept(num_layers, [i for i in range(num_layers) if i not in removed], stack=context.stack)
    return plan, held


@register_method("uidl")
class UIDLMethod(CompressionMethod):
    config_class = BlockSelectionConfig
    required_capabilities = frozenset({"layer_drop"})
    config: BlockSelectionConfig

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """UIDL: one walk keeping the last size + 1 boundaries, for the angular distance of every block of size
        n/blocks.

        - selection with ``tokens="last"`` (the default): the boundary entering the layer being run (the runner's
          layer-0 states while layer 0 runs, released after it: `walk_block_distances`), the last-token rows of the
          last size + 1 boundaries ((size + 1)·nsamples·d·b), the runner's call arguments, and the layer's run (its
          outputs so far and one batch's temporaries) or one batch's float64 cosine of those rows;
        - with ``tokens="all"``: the window of size + 1 whole boundaries beyond the layer-0 states (the boundary
          being computed among them), and the run or the float64 cosine of one batch (two float64 copies,
          16·T_b·d).
        """
        L = z.shape.num_layers
        size = max(1, n // max(config.num_blocks, 1))
        if getattr(config, "tokens", "last") == "last":
            rows = z.cal.nsamples * z.d
            _, arguments = z.runners(1)  # the layer-0 states are the boundary entering layer 0, then released
            terms = (
                arguments,
                Term("the boundary entering the layer being run", z.S, "the layer-0 states while layer 0 runs"),
                Term(
                    "last-token rows of the window", (size + 1) * rows * z.b, "one row a sequence, size + 1 boundaries"
                ),
                per_batch_term(z, 16 * z.cal.batch_size * z.d, "float64 last-token cosine"),
            )
            return [Phase("selection", (z.tokens(), *terms))], 1.0, False, []
        window = max(min(j, size) + 1 + (1 if j > size else 0) for j in range(L))
        terms = (
            Term(f"window of boundaries ({window - 1}) beyond the layer-0 states", (window - 1) * z.S, ""),
            per_batch_term(z, 16 * z.Tb * z.d, "float64 cosine of every real token"),
        )
        return [Phase("selection", (z.tokens(), *z.runners(1), *terms))], 1.0, False, []

    @classmethod
    def keeps_runner_states(cls, config: Any) -> bool:
        """The distance walk on last-token rows releases its runner's layer-0 states (`walk_block_distances`)."""
        return getattr(config, "tokens", "last") != "last"

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        block_size(num_to_remove, self.config.num_blocks, num_layers, first_start=0)

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        return select_blocks(adapter, context, num_to_remove, self.config, first_start=0)

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        apply_layer_drop_(adapter, plan)
