"""Running statistics over calibration tokens, accumulated in float64 with padding masked."""

from __future__ import annotations

import torch


class SecondMoment:
    """C = E[x xᵀ] over valid tokens, from a float64 running sum (no token matrix is ever stored).

    float64 matters: activations entering a down projection span several orders of magnitude, and the ridge
    solve downstream amplifies rounding in the small eigenvalues.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        self.count = 0

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) whose mask is 1."""
        flat = x.reshape(-1, x.shape[-1])
        if mask is not None:
            flat = flat[mask.reshape(-1).to(flat.device).bool()]
        flat = flat.to(self.sum.device, torch.float64)
        self.sum.addmm_(flat.T, flat)
        self.count += flat.shape[0]

    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        return self.sum / self.count
