"""ReplaceMe's selection and fit in one walk of the stack, batch by batch (issue 31, item 3).

The selection (UIDL's distance on the last token) needs every batch before it knows the block; the fit needs, for
that block, the MLP output M and the stream Y of the layer before it and the state L leaving it, token for token.
A walk layer by layer over all batches has M long before L: holding it is the window of size + 2 whole boundaries
(`uidl.walk_block_distances` with ``hold=True``), 18 GiB at LLaMA-2-7B; not holding it costs a second walk up to
the block's end (`linear_bridge.stream_bridge_statistics_`).

This walk turns the order round: each batch runs through every layer before the next starts
(`CalibratedStates.run_layers_on_batch`), so M, Y and L of one batch meet within the batch, and what is kept across
batches is the fit's float64 statistics (2·8·d² a start, 256 MiB at 7B) instead of states. Which starts get
statistics is decided before the walk, by the distances on the first batch alone (a probe: that batch through every
layer, 1/B of a stack pass): the `shortlist` nearest starts, as many as the byte budget holds. After the walk the
distances over all batches choose the block exactly as the layer-by-layer walk does (the same rows, the same floats);
if it is on the shortlist its statistics are complete and the fit is a solve, otherwise the caller streams the fit as
before. So the plan and the map never depend on the shortlist, only the cost does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import CalibratedStates, chosen_rows, mean_angle_of_rows
from ..corrections.bridge_fit import BridgeFit, FilledBridge, capture_mlp


@dataclass
class OnePassWalk:
    """What the walk found: every start's distance, the starts whose statistics it accumulated (nearest first on the
    probe batch) and their fits (`BridgeFit` of layer start − 1 towards the block's output, every batch added)."""

    distances: dict[int, float]
    shortlist: list[int]
    fits: dict[int, BridgeFit]

    def filled(self, size: int) -> FilledBridge | None:
        """The complete fit of the nearest start (the block one block is chosen as, `uidl.choose_blocks`), or None
        when that start was not on the shortlist."""
        best = min(self.distances, key=lambda s: (self.distances[s], s))
        return FilledBridge(best, size, self.fits[best]) if best in self.fits else None


def probe_distances(states: CalibratedStates, size: int, first_start: int) -> dict[int, float]:
    """Each start's angular distance over the first calibration batch alone (`mean_angle_of_rows`, over the ranks'
    first batches together, so every rank ranks the starts alike): the probe that chooses the shortlist. One batch
    through every layer."""
    runner, masks = states.runner, states.masks
    hidden = runner.inputs[0]
    rows = [chosen_rows(hidden, masks[0], "last")]
    for i in range(states.num_layers):
        hidden = states.run_layers_on_batch([i], hidden, 0)
        rows.append(chosen_rows(hidden, masks[0], "last"))
    starts = range(first_start, states.num_layers - size + 1)
    return {s: mean_angle_of_rows([rows[s]], [rows[s + size]]) for s in starts}


def walk_with_shortlist(
    adapter: ArchitectureAdapter,
    states: CalibratedStates,
    size: int,
    first_start: int,
    shortlist: int,
    budget_bytes: float,
    new_fit: Callable[[int, torch.device | str], BridgeFit],
    on_batch: Callable[[int], None] | None = None,
) -> OnePassWalk:
    """Distances of every start from `first_start` (>= 1: a fit needs the layer before the block), and the complete
    statistics of up to `shortlist` starts, in one walk batch by batch after a one-batch probe.

    `new_fit(start, device)` makes the empty fit of layer start − 1 on `device`; starts are taken nearest first on the
    probe while their statistics (`BridgeFit.nbytes`, sized on the meta device first, so a start over the budget
    allocates nothing) fit `budget_bytes` together. While the walk runs, a batch's captured M and Y of a
    shortlisted start are kept until the batch leaves that block (at most min(shortlist, size + 1) starts at once).
    The distances are `mean_angle_of_rows` of each batch's last-token rows, as `uidl.walk_block_distances` takes
    them: each batch runs through each layer op for op as the layer-by-layer runner runs it, so the same floats.
    """
    if first_start < 1:
        raise ValueError(f"a fitted start needs the layer before it: first_start must be 1 or more, got {first_start}.")
    runner, masks, num_layers = states.runner, states.masks, states.num_layers
    probe = probe_distances(states, size, first_start)
    fits: dict[int, BridgeFit] = {}
    used = 0
    for start in sorted(probe, key=lambda s: (probe[s], s)):
        if len(fits) == shortlist:
            break
        size_of = new_fit(start, "meta").nbytes
        if used + size_of > budget_bytes:
            break
        fits[start], used = new_fit(start, runner.inputs[0].device), used + size_of
    rows: list[list[torch.Tensor]] = [[] for _ in range(num_layers + 1)]
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with contextlib.ExitStack() as hooks:
        for start, fit in fits.items():
            hooks.enter_context(
                capture_mlp(
                    adapter,
                    states.layers[start - 1],
                    start - 1,
                    lambda x, y, start=start: captured.__setitem__(start, (x, y)),
                    read=fit.read,
                )
            )
        for b, hidden in enumerate(runner.inputs):
            rows[0].append(chosen_rows(hidden, masks[b], "last"))
            for i in range(num_layers):
                hidden = states.run_layers_on_batch([i], hidden, b)
                rows[i + 1].append(chosen_rows(hidden, masks[b], "last"))
                ended = i + 1 - size  # the block [ended, i] ends here
                if ended in fits:
                    x, y = captured.pop(ended)
                    fits[ended].add(b, x, y, hidden, masks[b])
                    del x, y
            del hidden
            if on_batch is not None:
                on_batch(b)
    distances = {s: mean_angle_of_rows(rows[s], rows[s + size]) for s in range(first_start, num_layers - size + 1)}
    return OnePassWalk(distances, list(fits), fits)
