"""Merging whole layers by their parameters (LaCo, Sliding-Window Merging)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def merge_by_differences(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """θ* = θ_0 + Σ_k (θ_k − θ_0), computed in float32 from the given (unmodified) parameters.

    This is the layer-collapse formula of LaCo and Sliding-Window Merging: the first layer absorbs what every
    other member adds on top of it. Inputs are never modified; the result has the first state's dtypes.
    """
    if not states:
        raise ValueError("merge_by_differences needs at least one layer's parameters.")
    base = states[0]
    for other in states[1:]:
        if set(other) != set(base):
            raise ValueError(f"layers to merge have different parameters: {sorted(set(other) ^ set(base))}.")
    merged = {}
    for name, tensor in base.items():
        first = tensor.float()
        total = first.clone()
        for other in states[1:]:
            total += other[name].float() - first
        merged[name] = total.to(tensor.dtype)
    return merged


def merge_as_reference_code(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What the published LaCo/SWM code computes: the last member's parameters.

    The reference loop updates the base layer in place, so each step adds (θ_k − θ_base_so_far) and the base
    ends up equal to the last layer. Offered only to reproduce published numbers.
    """
    if not states:
        raise ValueError("merge_as_reference_code needs at least one layer's parameters.")
    return {name: tensor.clone() for name, tensor in states[-1].items()}


MERGE_RULES = {"differences": merge_by_differences, "reference_code": merge_as_reference_code}
