"""CoMe's channel sensitivity and its Block-Influence shares (arXiv 2510.15304), as pure tensor functions.

A channel that enters an output projection (an MLP neuron entering W_down, a head-dim channel entering o_proj) is
scored by how strongly it is activated times how much the projection amplifies it: mean |x_c| over real tokens times
the L1 norm of column c of the projection. The number of channels (or KV groups) each layer of a merged pair keeps
is its share of the pair's Block Influence, rounded to whole units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

ShareRounding = Literal["nearest", "reference_code"]


def accumulate_abs_sum(inputs: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Per-channel sum of |x| over the real tokens of one batch, and how many tokens that is.

    Args:
        inputs: (batch, seq, channels) activations entering a projection.
        mask: (batch, seq), 1 on real tokens, 0 on padding; None counts every token.

    Returns:
        (channels,) float64 sums (on the device of `inputs`) and the number of tokens summed; dividing the sums over
        all batches by the total count gives the mean |activation| CoMe's score needs.
    """
    x = inputs.double().abs()
    if mask is None:
        return x.sum(dim=(0, 1)), x.shape[0] * x.shape[1]
    m = mask.to(device=x.device, dtype=torch.float64)
    return (x * m[..., None]).sum(dim=(0, 1)), int(m.sum().item())


def channel_sensitivity(mean_abs_activation: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(in,) float64 score of every input channel of a linear map: mean |x_c| × ‖W[:, c]‖₁.

    Args:
        mean_abs_activation: (in,) mean absolute activation of each channel entering the map.
        weight: (out, in) weight of the map (a `LinearView`'s layout).
    """
    if mean_abs_activation.shape != weight.shape[1:]:
        raise ValueError(
            f"one mean activation per input channel is needed: got {tuple(mean_abs_activation.shape)} for a weight "
            f"of shape {tuple(weight.shape)}."
        )
    column_l1 = weight.double().abs().sum(dim=0)
    return mean_abs_activation.double().to(column_l1.device) * column_l1


def head_channel_totals(channel_scores: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(num_heads,) sum of the channel scores of each head (the o_proj input is the heads' outputs side by side)."""
    if channel_scores.numel() % num_heads:
        raise ValueError(f"{channel_scores.numel()} o_proj input channels cannot be split into {num_heads} heads.")
    return channel_scores.reshape(num_heads, -1).sum(dim=1)


def proportional_shares(weights: Sequence[float], total: int, rounding: ShareRounding = "nearest") -> list[int]:
    """Whole numbers proportional to `weights` that sum to `total`.

    ``"nearest"`` is the largest-remainder rule: every share is its exact proportion rounded down, and the units
    left go to the largest fractional parts (ties to the larger weight, then the earlier member); for two members
    that is rounding each proportion to the nearest whole number. ``"reference_code"`` is the rule of the CoMe
    authors' code: every member but the one with the largest weight gets its proportion rounded down, and the
    largest gets the rest (so with 2 KV groups and shares 0.3 / 0.7 it keeps 0 and 2, where "nearest" keeps 1 and 1).
    All-zero weights share equally.

    Raises:
        ValueError: for negative or non-finite weights, or a negative total.
    """
    values = [float(w) for w in weights]
    if not values or any(not math.isfinite(w) or w < 0 for w in values):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}.")
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative integer, got {total!r}.")
    if rounding not in ("nearest", "reference_code"):
        raise ValueError(f"rounding must be 'nearest' or 'reference_code', got {rounding!r}.")
    norm = sum(values)
    fractions = [w / norm for w in values] if norm > 0 else [1.0 / len(values)] * len(values)
    exact = [total * f for f in fractions]
    largest = min(range(len(values)), key=lambda i: (-values[i], i))
    if rounding == "reference_code":
        shares = [0 if i == largest else math.floor(e) for i, e in enumerate(exact)]
        shares[largest] = total - sum(shares)
        return shares
    shares = [math.floor(e) for e in exact]
    order = sorted(range(len(values)), key=lambda i: (-(exact[i] - shares[i]), -values[i], i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares
