"""Folding a normalisation's affine part into the linear maps that read from it."""

from __future__ import annotations

import torch


def fold_norm_into_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (W', b') with ``W'(x̂) + b' == W(γ ⊙ x̂ + β) + b`` for a normalised input x̂.

    This is what lets several blocks share one parameter-free norm once they are concatenated: each block keeps
    its own gain inside its own projections. Computed in float64 and cast back, so folding adds no rounding beyond
    the final cast.

    Args:
        weight: (out, in) weight of the linear map reading the norm.
        bias: (out,) bias or None.
        norm_weight: (in,) gain γ of the norm.
        norm_bias: (in,) bias β of a LayerNorm, or None (RMSNorm).

    Returns:
        The folded weight and bias; the bias stays None when there was none and the norm has no bias.
    """
    dtype = weight.dtype
    w64 = weight.double()
    new_weight = (w64 * norm_weight.double()[None, :]).to(dtype)
    new_bias = bias
    if norm_bias is not None:
        shift = w64 @ norm_bias.double()
        new_bias = (shift if bias is None else bias.double() + shift).to(dtype)
    elif bias is not None:
        new_bias = bias.clone()
    return new_weight, new_bias
