"""Running statistics over calibration tokens with padding masked: float64 sums, or a float32 centred scatter with
its mean part exact in float64."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .distributed import all_reduce_, all_reduce_sums, is_sharded, process_group


@contextmanager
def tf32_matmul(enabled: bool) -> Iterator[None]:
    """Within the block, CUDA float32 matrix products may use TF32 when `enabled`; the caller's precision is restored
    after, so one statistic's choice never leaks into the user's model. torch's global precision switch is the one
    that mixes safely with both of its flag APIs (the older `allow_tf32` and the newer `fp32_precision`)."""
    if not enabled:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def float64_column_sum(flat: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Σ over rows in float64, `chunk_tokens` rows at a time: ``flat.sum(0, dtype=float64)`` casts the whole batch to
    float64 first (8 bytes a value: 2.7 GiB for one batch of 8 x 2048 tokens at LLaMA-2-7B's merged MLP width),
    where a chunk's cast is all the sum needs."""
    total = torch.zeros(flat.shape[-1], dtype=torch.float64, device=flat.device)
    for chunk in flat.split(chunk_tokens):
        total.add_(chunk.sum(dim=0, dtype=torch.float64))
    return total


class SecondMoment:
    """C = E[x xᵀ] over valid tokens, from a float64 running sum (no token matrix is ever stored).

    float64 accumulation matters: activations entering a down projection span several orders of magnitude, and the
    ridge solve downstream amplifies rounding in the small eigenvalues. The per-batch product, the expensive part
    (tokens × dim²), is computed in float32 on *centred* tokens and corrected exactly in float64:

        Σ x xᵀ = Σ (x − m)(x − m)ᵀ + m sᵀ + s mᵀ − n m mᵀ,   s = Σ x (float64), m = s / n rounded to float32.

    Centring removes the large common component that makes an uncentred float32 product lose the small directions;
    it costs half of a float64 product on CPUs. float64 inputs take the float64 path. ``tf32=True`` runs the per-batch
    centred product on CUDA's TF32 tensor cores, as `CentredSecondMoment` does (same bound; nothing changes on the CPU).
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu", tf32: bool = False) -> None:
        self.sum = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        self.count = 0
        self.tf32 = tf32

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
            total = float64_column_sum(flat)
            centre = (total / n).float()
            centred = flat.float() - centre
            m = centre.double()
            # In place: a float64 copy of the product or of an outer product would be another dim² matrix.
            with tf32_matmul(self.tf32 and self.sum.device.type == "cuda"):
                product = centred.T @ centred
            self.sum.add_(product)
            del product
            self.sum.addr_(m, total).addr_(total, m).addr_(m, m, alpha=-n)
        self.count += n

    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        return self.sum / self.count

    def finish(self) -> torch.Tensor:
        """The mean, computed in place in the running sum (which is consumed): one dim² matrix instead of two.

        Under a sharded calibration the sum and the count are first summed over the ranks (the statistic is complete
        only then)."""
        if is_sharded():
            all_reduce_(self.sum)
            (count,) = all_reduce_sums(self.count)
            self.count = int(count)
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        result, self.sum = self.sum.div_(self.count), None
        return result


class CentredSecondMoment:
    """C = E[x xᵀ] kept as a float32 scatter about a fixed centre, with the mean part exact in float64.

    Half the memory of `SecondMoment` and no dim² float64 work per batch: each batch adds its centred product straight
    into the float32 running scatter (in chunks of `chunk_tokens` tokens, so no product or token copy of a whole batch
    is ever materialised). With c the centre (the first batch's mean, rounded to float32), s = Σ x in float64 and n
    tokens,

        Σ x xᵀ = Σ (x − c)(x − c)ᵀ + c sᵀ + s cᵀ − n c cᵀ,   so   C = M / n + μ μᵀ − δ δᵀ,   μ = s / n, δ = μ − c,

    where M is the float32 scatter. The rank-two mean part is never added into M: `CentredMoment` adds it in float64
    to each block it hands out. What is rounded is therefore only the scatter about a point close to the mean, which
    carries no large common component (the reason an uncentred float32 sum loses the small directions); the error
    is a few float32 roundings relative to the scatter's own entries (bounded against `SecondMoment` in
    tests/ops/test_ridge_blocked.py).

    ``tf32=True`` lets CUDA run the scatter's products on TF32 tensor cores (inputs rounded, or truncated on some
    hardware, to 10 mantissa bits; products and sums in float32): each entry within (2·2⁻¹⁰ + 2⁻²⁰ + γₙ₊₂) of
    Σ |y_i||y_j| (y = x − c; tested on CUDA against float64, tests/ops/test_ridge_blocked.py), and FlattenGPT's
    covariance phase at LLaMA-2-7B shape on an H100 went from 36 to 11 s. It changes nothing on the CPU, which has
    no TF32.
    """

    def __init__(
        self, dim: int, device: torch.device | str = "cpu", chunk_tokens: int = 4096, tf32: bool = False
    ) -> None:
        self.tf32 = tf32
        self.scatter = torch.zeros(dim, dim, dtype=torch.float32, device=device)
        self.total = torch.zeros(dim, dtype=torch.float64, device=device)
        self.centre: torch.Tensor | None = None
        self.count = 0
        self.chunk_tokens = chunk_tokens

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) whose mask is 1."""
        flat = x.reshape(-1, x.shape[-1])
        if mask is not None:
            flat = flat[mask.reshape(-1).to(flat.device).bool()]
        flat = flat.to(self.scatter.device)
        n = flat.shape[0]
        if n == 0:
            return
        total = float64_column_sum(flat, self.chunk_tokens)
        if self.centre is None:
            self.centre = (total / n).float()
        self.total.add_(total)
        with tf32_matmul(self.tf32 and self.scatter.device.type == "cuda"):
            for chunk in flat.split(self.chunk_tokens):
                centred = chunk.float() - self.centre
                self.scatter.addmm_(centred.T, centred)
        self.count += n

    def finish(self) -> CentredMoment:
        """The statistic as a `CentredMoment` (the running scatter is divided in place and handed over); under a
        sharded calibration, summed over the ranks first (`_all_reduce_`)."""
        if is_sharded():
            self._all_reduce_()
        if self.count == 0 or self.centre is None:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        mean = self.total / self.count
        result = CentredMoment(self.scatter.div_(self.count), mean, mean - self.centre.double())
        self.scatter = None
        return result

    def _all_reduce_(self) -> None:
        """Sums the statistic over the ranks about one common centre c: the centre of the lowest rank that has one
        (rank 0's first batch's mean, the centre one process takes on the same batches). A rank's scatter about its
        own centre c_r moves to c by the exact identity

            Σ (x − c)(x − c)ᵀ = Σ (x − c_r)(x − c_r)ᵀ + u dᵀ + d uᵀ + n d dᵀ,   u = s − n c_r,  d = c_r − c,

        with u and d in float64 and the rank-two update added into the float32 scatter (a few float32 roundings of
        its entries, the statistic's own error; no dim² float64 matrix). Then the scatters, sums and counts add up.
        """
        dim = self.total.shape[0]
        rank, world = process_group()
        centres = torch.zeros(world, dim + 1, dtype=torch.float64, device=self.total.device)
        if self.centre is not None:
            centres[rank, 0] = 1.0
            centres[rank, 1:] = self.centre.double()
        all_reduce_(centres)
        having = torch.nonzero(centres[:, 0]).flatten()
        if having.numel() == 0:
            return  # no rank saw a token: `finish` says so
        common = centres[int(having[0]), 1:].float()
        if self.centre is not None and not torch.equal(self.centre, common):
            d = self.centre.double() - common.double()
            u = self.total - self.count * self.centre.double()
            d32, u32 = d.float(), u.float()
            self.scatter.addr_(u32, d32).addr_(d32, u32).addr_(d32, d32, alpha=float(self.count))
        self.centre = common.to(self.scatter.device)
        all_reduce_(self.scatter)
        all_reduce_(self.total)
        (count,) = all_reduce_sums(self.count)
        self.count = int(count)


class CentredMoment:
    """C = S + μ μᵀ − δ δᵀ with S a float32 (dim × dim) matrix and μ, δ float64 vectors; read in float64 blocks.

    Whoever needs C in float64 asks for the block it needs (`block`, `columns`), so only that block ever exists in
    float64. `release()` drops S once the last block has been read.
    """

    def __init__(self, scatter: torch.Tensor, mean: torch.Tensor, offset: torch.Tensor) -> None:
        self.scatter, self.mean, self.offset = scatter, mean, offset

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def diagonal(self) -> torch.Tensor:
        return self.scatter.diagonal().double() + self.mean.square() - self.offset.square()

    def trace(self) -> float:
        return float(self.diagonal().sum())

    def block(self, rows: torch.Tensor | slice, cols: torch.Tensor | slice) -> torch.Tensor:
        """C[rows, cols] in float64 (rows and cols: index tensors or slices)."""
        device = self.mean.device
        rows = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long, device=device)
        cols = cols if isinstance(cols, slice) else torch.as_tensor(cols, dtype=torch.long, device=device)
        # Columns first: the callers ask for few columns (a panel, a chunk) and possibly many rows.
        part = self.scatter[:, cols] if isinstance(cols, slice) else self.scatter.index_select(1, cols)
        part = part[rows] if isinstance(rows, slice) else part.index_select(0, rows)
        result = part.double()
        result.addr_(self.mean[rows], self.mean[cols]).addr_(self.offset[rows], self.offset[cols], alpha=-1.0)
        return result

    def release(self) -> None:
        self.scatter = None


class CrossMoment:
    """S = E[x yᵀ] and E‖y‖² over valid tokens, from float64 running sums, a chunk of tokens at a time.

    The partner of `SecondMoment` when a projection is refitted towards a target y that is not its own output
    (`ops.ridge.ridge_refit_to_target`). Both widths are a layer's (heads × head_dim by hidden), so the float64
    product costs what a second moment of the smaller width does and no centring is needed for the memory.
    """

    def __init__(self, dim: int, out_dim: int, device: torch.device | str = "cpu", chunk_tokens: int = 4096) -> None:
        self.sum = torch.zeros(dim, out_dim, dtype=torch.float64, device=device)
        self.energy = 0.0
        self.count = 0
        self.chunk_tokens = chunk_tokens

    def update(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) and `y` (batch, seq, out_dim) whose mask is 1."""
        xs, ys = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1).bool()
            xs, ys = xs[keep.to(xs.device)], ys[keep.to(ys.device)]
        for start in range(0, xs.shape[0], self.chunk_tokens):
            a = xs[start : start + self.chunk_tokens].to(self.sum.device, torch.float64)
            b = ys[start : start + self.chunk_tokens].to(self.sum.device, torch.float64)
            self.sum.addmm_(a.T, b)
            self.energy += float(b.square().sum())
        self.count += xs.shape[0]

    def finish(self) -> tuple[torch.Tensor, float]:
        """(E[x yᵀ], E‖y‖²); the running sum is consumed. Under a sharded calibration, summed over the ranks first."""
        if is_sharded():
            all_reduce_(self.sum)
            energy, count = all_reduce_sums(self.energy, self.count)
            self.energy, self.count = energy, int(count)
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        return self.sum.div_(self.count), self.energy / self.count
