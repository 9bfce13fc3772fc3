"""Choosing which layers to group, as pure functions of scores."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..utils import flops


def host_scores(scores: torch.Tensor) -> list[float]:
    """The scores as Python floats, read from the device in one transfer.

    Ranking needs every score on the host; reading them one `float()` at a time is one device sync each (11,008 of
    them for a 7B MLP's leverage scores), which a single copy replaces. float64 holds every float32/bf16 value
    exactly, so the order is the tensor's.
    """
    flops.record_host_reads(1)
    return scores.detach().reshape(-1).to("cpu", torch.float64).tolist()


def _ranked(values: list[float]) -> list[int]:
    """Positions of `values` from the largest down, ties broken by the lower index (deterministic)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def top_k_indices(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest scores, ascending (ties broken by the lower index, so results are deterministic)."""
    return sorted(_ranked(host_scores(scores))[:k])


def balanced_top_k(scores: torch.Tensor, k: int, parts: int) -> list[int]:
    """The k largest scores taken evenly from `parts` equal contiguous segments (a merged group's members): each
    keeps its k // parts best; the k % parts left over go to the segments whose next-best score is largest. Ascending,
    ties broken by the lower index, like `top_k_indices`."""
    size = scores.numel() // parts
    if size * parts != scores.numel() or not 0 <= k <= scores.numel():
        raise ValueError(f"cannot take {k} of {scores.numel()} scores evenly from {parts} segments.")
    values = host_scores(scores)
    ranked = [_ranked(values[p * size : (p + 1) * size]) for p in range(parts)]
    share = k // parts
    chosen = [p * size + i for p, r in enumerate(ranked) for i in r[:share]]
    spare = sorted((p for p in range(parts) if share < size), key=lambda p: (-values[p * size + ranked[p][share]], p))
    chosen += [p * size + ranked[p][share] for p in spare[: k % parts]]
    return sorted(chosen)


def greedy_adjacent_groups(
    similarity: torch.Tensor,
    num_to_remove: int,
    max_group_size: int | None = None,
    one_kind: Callable[[tuple[int, ...]], bool] | None = None,
) -> list[tuple[int, ...]]:
    """FlattenGPT's greedy selection (Algorithm 1) with the row/column deletion rule.

    Every layer starts as its own group. At each step the adjacent pair of groups (A, B) whose similarity
    S[first(A), last(B)] is highest is merged: after merging (l-1, l), column l-1 and row l are deleted, so a group
    keeps the row of its first member and the column of its last, and a chain of three or more layers is judged
    by the similarity of its first and last members. Each merge removes one layer.

    Args:
        similarity: (L, L) matrix, S[i, j] for i < j the mean cosine similarity of the inputs of layers i and j;
            NaN entries (outside a computed band) are never chosen.
        num_to_remove: number of merges to perform.
        max_group_size: largest allowed group (None: no limit).
        one_kind: whether a group's layers are of one kind (sliding and full attention, NoPE layers never share a
            merged block); None: every group is.

    Returns:
        The groups as tuples of original indices, covering 0..L-1 in order.

    Raises:
        ValueError: when no admissible merge is left before `num_to_remove` merges were made.
    """
    num_layers = similarity.shape[0]
    groups: list[list[int]] = [[i] for i in range(num_layers)]
    limit = max_group_size if max_group_size is not None else num_layers
    for step in range(num_to_remove):
        scored = []
        for g in range(len(groups) - 1):
            a, b = groups[g], groups[g + 1]
            if len(a) + len(b) > limit or (one_kind is not None and not one_kind((*a, *b))):
                continue
            score = float(similarity[a[0], b[-1]])
            if not math.isnan(score):
                scored.append((-score, g))
        # The most similar pair whose merge leaves the rest of the target reachable: a merge that strands it (a
        # group grown across the only place where two runs of one kind could still join) would fail later anyway,
        # so skipping it changes no plan that succeeds. Usually the first pair passes, one check a step.
        remaining = num_to_remove - step - 1
        best = next((g for _, g in sorted(scored) if merge_leaves_room(groups, g, remaining, limit, one_kind)), None)
        if best is None:
            raise ValueError(
                f"after {step} merge(s) no adjacent groups of one layer kind can be merged within max_group_size="
                f"{max_group_size}; requested {num_to_remove}. Raise max_group_size or remove fewer layers."
            )
        groups[best : best + 2] = [groups[best] + groups[best + 1]]
    return [tuple(g) for g in groups]


def merge_leaves_room(
    groups: Sequence[Sequence[int]],
    g: int,
    remaining: int,
    limit: int,
    one_kind: Callable[[tuple[int, ...]], bool] | None,
) -> bool:
    """Whether `remaining` more merges are still possible after groups g and g + 1 are merged: a greedy merging
    method (FlattenGPT's pairing, CoMe's) skips a merge that would strand the rest of its target."""
    if remaining == 0:
        return True
    merged = [tuple(x) for x in (*groups[:g], (*groups[g], *groups[g + 1]), *groups[g + 2 :])]
    return max_merges(merged, limit, one_kind) >= remaining


def max_merges(
    groups: Sequence[tuple[int, ...]], limit: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
) -> int:
    """The most merges still possible from `groups` when no group may exceed `limit` layers (nor, with `one_kind`,
    join layers of different kinds).

    Merging only ever joins adjacent groups, so the best is a partition of the sequence into consecutive runs of
    total size at most `limit`, with as few runs as possible (each run of k groups is k − 1 merges): a shortest-path
    recursion over the sequence, G × G at most. A run that mixes kinds stays mixed as it grows, as one too large stays
    too large, so both end the inner loop.
    """
    sizes = [len(g) for g in groups]
    fewest = [0] + [len(sizes) + 1] * len(sizes)  # fewest[j]: fewest runs covering the first j groups
    for j in range(1, len(sizes) + 1):
        total = 0
        for i in range(j - 1, -1, -1):
            total += sizes[i]
            if total > limit or (one_kind is not None and not one_kind(tuple(x for g in groups[i:j] for x in g))):
                break
            fewest[j] = min(fewest[j], fewest[i] + 1)
    return len(sizes) - fewest[-1]
