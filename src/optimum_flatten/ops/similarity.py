"""Token-wise cosine similarity between residual-stream states, with padding masked."""

from __future__ import annotations

import torch


def masked_cosine_sum(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> tuple[float, int]:
    """Sum over valid tokens of cos(a_t, b_t), and the number of valid tokens.

    Args:
        a, b: (batch, seq, hidden) states.
        mask: (batch, seq) 1 for real tokens; None means all count.
    """
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-12)
    if mask is None:
        return float(cos.sum()), cos.numel()
    m = mask.to(cos.device, torch.float64)
    return float((cos * m).sum()), int(m.sum().item())
