"""Attention head importance of FlattenGPT (eq. 12): the norm of each head's contribution to the residual stream.

f_i = E_tokens ‖ softmax(q_i k_iᵀ) X W_V,i · diag(W_O,i W_O,iᵀ)^½ ‖: the head's output (what enters o_proj for that
head) with every head-dim channel scaled by the norm of the o_proj column it feeds.
"""

from __future__ import annotations

import torch


def o_proj_column_norms(o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(num_heads, head_dim) Euclidean norms of the o_proj columns, i.e. diag(W_O,i W_O,iᵀ)^½ per head.

    Args:
        o_weight: (hidden, num_heads * head_dim) weight of the output projection, in the (out, in) layout.
        num_heads: number of query heads feeding it.
    """
    norms = o_weight.double().norm(dim=0)
    return norms.reshape(num_heads, -1)


def accumulate_head_importance(
    head_inputs: torch.Tensor, column_norms: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """Sums the per-token score of every head over valid tokens.

    Args:
        head_inputs: (batch, seq, num_heads * head_dim) input of o_proj (concatenated head outputs).
        column_norms: (num_heads, head_dim) from `o_proj_column_norms`.
        mask: (batch, seq) 1 for real tokens, 0 for padding; None means all tokens count.

    Returns:
        (num_heads,) float64 sum of scores over valid tokens, and the number of valid tokens.
    """
    num_heads, head_dim = column_norms.shape
    x = head_inputs.double().reshape(*head_inputs.shape[:-1], num_heads, head_dim)
    per_token = (x * column_norms.to(x.device)).norm(dim=-1)  # (batch, seq, heads)
    if mask is None:
        return per_token.sum(dim=(0, 1)), per_token.shape[0] * per_token.shape[1]
    m = mask.to(per_token.device, torch.float64)
    return (per_token * m[..., None]).sum(dim=(0, 1)), int(m.sum().item())


def kv_group_scores(head_scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Total score of each key/value group (query heads ``g * r .. g * r + r - 1`` share KV head ``g``)."""
    return head_scores.reshape(num_kv_heads, -1).sum(dim=1)
