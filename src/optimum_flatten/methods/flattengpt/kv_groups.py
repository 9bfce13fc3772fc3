"""Which KV groups a merged pair keeps when heads are chosen by reconstruction (`head_selection="reconstruction"`):
the subset whose heads, refit by ridge, best reproduce the attention output (or another target)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ...ops import ridge_reconstruction_error
from ...ops.block_elimination import greedy_block_elimination
from ...ops.ridge import ridge_target_error
from ...utils import flops
from .choices import MAX_EXHAUSTIVE_SUBSETS


def select_kv_groups_by_reconstruction(
    second_moment: torch.Tensor,
    o_rows: torch.Tensor,
    geometry: Any,
    num_keep: int,
    lam: float,
    target: tuple[torch.Tensor, float] | None = None,
) -> list[int]:
    """The `num_keep` KV groups whose heads, refit by ridge, best reproduce the full attention output, or `target`
    when given: (E[a tᵀ], E‖t‖²) of another target t (`attention_target="sequential"`).

    Exhaustive over all subsets when there are at most MAX_EXHAUSTIVE_SUBSETS of them, else greedy backward
    elimination (repeatedly drop the group whose removal costs least; `ops.block_elimination`): one factorisation a
    pair, each step scoring every removal from it and downdating it, where at LLaMA-2-7B (64 KV groups a merged pair,
    32 kept) a refit per candidate took about 1,550 factorisations and a factorisation a step 32.
    """

    def error(groups: Sequence[int]) -> float:
        channels = torch.tensor(geometry.head_channels(geometry.query_heads_of(groups)))
        if target is not None:
            return ridge_target_error(second_moment, target[0], target[1], o_rows, channels, lam)
        return ridge_reconstruction_error(second_moment, o_rows, channels, lam)

    groups = list(range(geometry.num_kv_heads))
    if math.comb(len(groups), num_keep) <= MAX_EXHAUSTIVE_SUBSETS:
        return list(min(itertools.combinations(groups, num_keep), key=error))
    if target is None:  # the wide block's own output t = a W: S = C W, E‖t‖² = tr(Wᵀ C W)
        flops.record(flops.product(o_rows.shape[0], o_rows.shape[0], o_rows.shape[1]), "float64")
        cross = second_moment.double() @ o_rows.double()
        target = (cross, float((o_rows.double() * cross).sum()))
    blocks = [torch.tensor(geometry.head_channels(geometry.query_heads_of([g]))) for g in groups]
    kept = greedy_block_elimination(second_moment, target[0], target[1], o_rows, blocks, num_keep, lam)
    return [groups[i] for i in kept]
