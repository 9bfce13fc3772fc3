"""Running statistics over calibration tokens, accumulated in float64 with padding masked."""

from __future__ import annotations

import torch


class SecondMoment:
    """C = E[x xᵀ] over valid tokens, from a float64 running sum (no token matrix is ever stored).

    float64 accumulation matters: activations entering a down projection span several orders of magnitude, and the
    ridge solve downstream amplifies rounding in the small eigenvalues. The per-batch product, the expensive part
    (tokens × dim²), is computed in float32 on *centred* tokens and corrected exactly in float64:

        Σ x xᵀ = Σ (x − m)(x − m)ᵀ + m sᵀ + s mᵀ − n m mᵀ,   s = Σ x (float64), m = s / n rounded to float32.

    Centring removes the large common component that makes an uncentred float32 product lose the small directions;
    it costs half of a float64 product on CPUs. float64 inputs take the float64 path.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        self.count = 0

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) whose mask is 1."""
        flat = x.reshape(-1, x.shape[-1])
        if mask is not None:
            flat = flat[mask.reshape(-1).to(flat.device).bool()]
        flat = flat.to(self.sum.device)
        n = flat.shape[0]
        if n == 0:
            return
        if flat.dtype == torch.float64:
            self.sum.addmm_(flat.T, flat)
        else:
            total = flat.sum(dim=0, dtype=torch.float64)
            centre = (total / n).float()
            centred = flat.float() - centre
            m = centre.double()
            # In place: a float64 copy of the product or of an outer product would be another dim² matrix.
            self.sum.add_(centred.T @ centred)
            self.sum.addr_(m, total).addr_(total, m).addr_(m, m, alpha=-n)
        self.count += n

    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        return self.sum / self.count

    def finish(self) -> torch.Tensor:
        """The mean, computed in place in the running sum (which is consumed): one dim² matrix instead of two."""
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        result, self.sum = self.sum.div_(self.count), None
        return result
