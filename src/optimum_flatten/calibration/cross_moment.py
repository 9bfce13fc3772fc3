"""The cross moment E[x yᵀ] of a projection's input with a target it is refitted towards (`CrossMoment`), beside the
second moments of `stats.py`: float64 sums, or products of centred float32 or split bfloat16 chunks with the mean
part added back in float64 (`precision.py`)."""

from __future__ import annotations

import functools

import torch

from ..utils import flops
from .distributed import all_reduce_, all_reduce_sums, is_sharded
from .precision import batch_centre, centred_float32, float64_column_sum, split_cross

#: Output columns per float32 product of `CrossMoment`'s centred path: its temporary is the input width × this
#: (59 MiB at LLaMA-2-70B's merged MLP of 57,344 channels), where the float64 path adds into its sum in place.
CROSS_BLOCK = 256


#: Rows per float64 cast in `CrossMoment`'s centred path's column sums.
COLUMN_SUM_ROWS = 256


class CrossMoment:
    """S = E[x yᵀ] and E‖y‖² over valid tokens, from float64 running sums, a chunk of tokens at a time.

    The partner of `SecondMoment` when a projection is refitted towards a target y that is not its own output
    (`ops.ridge.ridge_refit_to_target`). Both widths are a layer's (heads × head_dim by hidden), so the float64
    product costs what a second moment of the smaller width does and no centring is needed for the memory.

    ``split_bfloat16=True`` (FlattenGPT's ``covariance_dtype="bfloat16"``) takes each chunk's product on the bfloat16
    tensor cores instead, with the arithmetic of `split_cross`: both sides centred on the batch's means rounded to
    bfloat16 (the mean part added back exactly in float64, as `SecondMoment` does), each entry of a chunk's product
    within (3·2⁻¹⁶ + γ₃ₖ) Σ |x_i − c_i||y_j − e_j| of the float64 one (k = `chunk_tokens`), chunks summed in float64.

    ``centred_float32=True`` (FlattenGPT's float32 and tf32 statistics of float32 activations) takes each chunk's
    product in float32 on the same centred sides, the centres the batch's means rounded to float32 and the mean part
    again added back in float64: each entry of a chunk's product within γₖ₊₂ Σ |x_i − c_i||y_j − e_j| of the float64
    one (the centring's two float32 roundings and the float32 sums of one chunk), chunks summed in float64. Why: the
    float64 products and the float64 copies of both sides were a quarter of FlattenGPT's CPU compression (a float64
    GEMM runs at half the float32 rate there; on an H100 the two rates are the same), and centring removes the common
    component that would make a float32 sum lose the small directions, as it does for `SecondMoment`. float64 inputs
    keep the float64 path.
    """

    def __init__(
        self,
        dim: int,
        out_dim: int,
        device: torch.device | str = "cpu",
        chunk_tokens: int = 4096,
        split_bfloat16: bool = False,
        centred_float32: bool = False,
    ) -> None:
        if split_bfloat16 and centred_float32:
            raise ValueError("CrossMoment takes split_bfloat16=True or centred_float32=True, not both.")
        self.sum = torch.zeros(dim, out_dim, dtype=torch.float64, device=device)
        self.energy = 0.0
        self.count = 0
        self.chunk_tokens = chunk_tokens
        self.split = split_bfloat16
        self.centred = centred_float32

    def update(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) and `y` (batch, seq, out_dim) whose mask is 1."""
        xs, ys = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1).bool()
            xs, ys = xs[keep.to(xs.device)], ys[keep.to(ys.device)]
        if self.split or (self.centred and xs.dtype != torch.float64 and ys.dtype != torch.float64):
            self._add_centred(xs, ys)
            return
        flops.record(flops.gram(xs.shape[0], xs.shape[1], ys.shape[1]), "float64")
        for start in range(0, xs.shape[0], self.chunk_tokens):
            a = xs[start : start + self.chunk_tokens].to(self.sum.device, torch.float64)
            b = ys[start : start + self.chunk_tokens].to(self.sum.device, torch.float64)
            self.sum.addmm_(a.T, b)
            self.energy += float(b.square().sum())
        self.count += xs.shape[0]

    def _add_centred(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        """One batch on a centred path: Σ x yᵀ = Σ (x − c)(y − e)ᵀ + c s_yᵀ + s_x eᵀ − n c eᵀ, with s the float64
        column sums and c, e the batch's means rounded by `batch_centre` (to bfloat16 on the split path, float32 on
        the centred float32 one), each chunk's product by `_add_chunk`; E‖y‖² from float64 copies of y's chunks."""
        n = xs.shape[0]
        if n == 0:
            return
        xs, ys = xs.to(self.sum.device), ys.to(self.sum.device)
        # The centred float32 path sums a few rows at a time: its float64 casts stay small beside its float32 copies.
        column_sum = (
            float64_column_sum if self.split else functools.partial(float64_column_sum, chunk_tokens=COLUMN_SUM_ROWS)
        )
        sum_x, sum_y = column_sum(xs), column_sum(ys)
        centre_x, centre_y = batch_centre(sum_x, n, self.split), batch_centre(sum_y, n, self.split)
        if not self.split:  # `split_cross` records its own
            flops.record(flops.gram(n, xs.shape[1], ys.shape[1]), "float32")
        for start in range(0, n, self.chunk_tokens):
            b = ys[start : start + self.chunk_tokens]
            self._add_chunk(
                centred_float32(xs[start : start + self.chunk_tokens], centre_x), centred_float32(b, centre_y)
            )
            self.energy += float(b.double().square().sum())
        c, e = centre_x.double(), centre_y.double()
        self.sum.addr_(c, sum_y).addr_(sum_x, e).addr_(c, e, alpha=-n)
        self.count += n

    def _add_chunk(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adds aᵀ b of one chunk's centred float32 sides: `split_cross`'s bfloat16 GEMM, or float32 products by
        blocks of `CROSS_BLOCK` output columns (the product's temporary stays dim × CROSS_BLOCK)."""
        if self.split:
            self.sum.add_(split_cross(a, b))
            return
        for j in range(0, b.shape[1], CROSS_BLOCK):
            self.sum[:, j : j + CROSS_BLOCK].add_(a.T @ b[:, j : j + CROSS_BLOCK])

    def finish(self) -> tuple[torch.Tensor, float]:
        """(E[x yᵀ], E‖y‖²); the running sum is consumed. Under a sharded calibration, summed over the ranks first."""
        if is_sharded():
            all_reduce_(self.sum)
            energy, count = all_reduce_sums(self.energy, self.count)
            self.energy, self.count = energy, int(count)
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        return self.sum.div_(self.count), self.energy / self.count
