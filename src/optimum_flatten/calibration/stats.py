"""Running statistics over calibration tokens with padding masked: float64 sums, or a float32 centred scatter with
its mean part exact in float64.

The second moments live here; the cross moment with a target in `cross_moment.py`, and the product arithmetic both
rest on (TF32, split bfloat16, banded Gram products, float64 column sums and centring) in `precision.py`. Their names
are re-exported here, where the callers have always imported them from."""

from __future__ import annotations

import torch

from ..utils import flops
from ..utils.launch import process_group
from .cross_moment import COLUMN_SUM_ROWS, CROSS_BLOCK, CrossMoment
from .distributed import all_reduce_, all_reduce_sums, is_sharded
from .precision import (
    SPLIT_CHUNK_TOKENS,
    SPLIT_GRAM_BAND,
    add_lower_bands_,
    add_lower_split_gram_,
    batch_centre,
    centred_float32,
    exact_bfloat16_reduction,
    float64_column_sum,
    split_bfloat16,
    split_cross,
    tf32_matmul,
)

__all__ = [
    "COLUMN_SUM_ROWS",
    "CROSS_BLOCK",
    "GRAM_BAND",
    "SPLIT_CHUNK_TOKENS",
    "SPLIT_GRAM_BAND",
    "TRIANGULAR_GRAM_DEVICES",
    "CentredMoment",
    "CentredSecondMoment",
    "CrossMoment",
    "SecondMoment",
    "add_lower_gram_",
    "add_lower_split_gram_",
    "batch_centre",
    "centred_float32",
    "exact_bfloat16_reduction",
    "float64_column_sum",
    "mirror_lower_",
    "real_rows",
    "split_bfloat16",
    "split_cross",
    "tf32_matmul",
    "triangular_gram",
]


#: Devices whose float32 Gram products (`add_lower_gram_`) take only the lower block triangle of yᵀy, a band of
#: `GRAM_BAND` columns at a time, and mirror it once when the statistic is read: (d + b)/(2d) of the full product's
#: multiply-adds. On the CPU that is the time too (4,096 tokens x 3,072 channels, one thread: 0.46 -> 0.29 s, and the
#: lower triangle came out bit-identical to the full product's); on CUDA it is unmeasured, and the full product
#: (one GEMM launch) stays.
TRIANGULAR_GRAM_DEVICES = ("cpu",)


#: Columns per band of `add_lower_gram_`: narrow enough to skip most of the upper triangle, wide enough that each
#: band stays one efficient GEMM (384 to 768 timed within 5% of each other at 3,072 channels).
GRAM_BAND = 384


def triangular_gram(device: torch.device) -> bool:
    """Whether Gram products on `device` take the lower block triangle only (`TRIANGULAR_GRAM_DEVICES`)."""
    return device.type in TRIANGULAR_GRAM_DEVICES


def add_lower_gram_(out: torch.Tensor, y: torch.Tensor, band: int | None = None) -> torch.Tensor:
    """out += yᵀ y on its lower block triangle only: for each band of `band` columns, the rows from the band's first
    on (the diagonal block whole). Every entry computed is the dot product the full GEMM computes, with the same
    float32 sums; the entries above the diagonal blocks are left as they were, for `mirror_lower_` to fill once
    all the products are in (`band` None: `GRAM_BAND`, read at the call). Returns `out`."""
    return add_lower_bands_(out, y, y, band or GRAM_BAND, "float32", lambda block, a, b: block.addmm_(a, b))


def mirror_lower_(matrix: torch.Tensor, band: int | None = None) -> torch.Tensor:
    """Copies the lower block triangle `add_lower_gram_` fills (with the same `band`) onto the entries above it, each
    diagonal block's lower triangle onto its upper one included, so the matrix is symmetric bit for bit; one band's
    copy at a time. Returns `matrix`.

    The diagonal blocks need it too: `add_lower_split_gram_`'s sum hiᵀlo + loᵀhi in the other order across the
    diagonal, and even one float32 GEMM's yᵀy need not give entries (i, j) and (j, i) alike (torch 2.14.1's CPU
    build does not, on an AMD EPYC; 2.13.0's did). The copy costs one band² select a band."""
    band = band or GRAM_BAND
    for start in range(0, matrix.shape[0], band):
        stop = min(start + band, matrix.shape[0])
        if start:
            matrix[:start, start:stop].copy_(matrix[start:stop, :start].T)
        block = matrix[start:stop, start:stop]
        upper = torch.ones_like(block, dtype=torch.bool).triu_(1)
        block.copy_(torch.where(upper, block.T, block))
    return matrix


def real_rows(x: torch.Tensor, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The rows of `x` (batch, seq, dim) whose mask is 1, as (tokens, dim) on `device`: padding never reaches a sum.

    Where every token is real (packed calibration) the rows are `x` itself, reshaped: the masked copy would be the
    same values in the same order (a batch's worth of memory and a pass over it for nothing). The statistics only
    read the rows, so a view is safe."""
    flat = x.reshape(-1, x.shape[-1])
    if mask is not None:
        keep = mask.reshape(-1).to(flat.device).bool()
        if not bool(keep.all()):
            flat = flat[keep]
    return flat.to(device)


class _MaskedMoment:
    """What `SecondMoment` and `CentredSecondMoment` share: the exclusive choice of product precision, the masked
    token rows each update reads, and the float32 centre a batch's product is taken about. Both rest on the same
    identity (a float64 mean part beside a product of centred tokens), so the centre is rounded by one rule."""

    def __init__(self, tf32: bool, split_bfloat16: bool) -> None:
        if tf32 and split_bfloat16:
            raise ValueError(f"{type(self).__name__} takes tf32=True or split_bfloat16=True, not both.")
        self.tf32 = tf32
        self.split = split_bfloat16
        self.count = 0

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Adds the tokens of `x` (batch, seq, dim) whose mask is 1."""
        flat = real_rows(x, mask, self._home().device)
        if flat.shape[0] > 0:
            self._add(flat)

    def _home(self) -> torch.Tensor:
        """The running sum, whose device every token is moved to."""
        raise NotImplementedError

    def _add(self, flat: torch.Tensor) -> None:
        """Adds the (tokens, dim) rows `flat`, at least one."""
        raise NotImplementedError

    def _centre(self, total: torch.Tensor, n: int) -> torch.Tensor:
        return batch_centre(total, n, self.split)


class SecondMoment(_MaskedMoment):
    """C = E[x xᵀ] over valid tokens, from a float64 running sum (no token matrix is ever stored).

    float64 accumulation matters: activations entering a down projection span several orders of magnitude, and the
    ridge solve downstream amplifies rounding in the small eigenvalues. The per-batch product, the expensive part
    (tokens × dim²), is computed in float32 on *centred* tokens and corrected exactly in float64:

        Σ x xᵀ = Σ (x − m)(x − m)ᵀ + m sᵀ + s mᵀ − n m mᵀ,   s = Σ x (float64), m = s / n rounded to float32.

    Centring removes the large common component that makes an uncentred float32 product lose the small directions;
    it costs half of a float64 product on CPUs. float64 inputs take the float64 path. ``tf32=True`` runs the per-batch
    centred product on CUDA's TF32 tensor cores, as `CentredSecondMoment` does (same bound; nothing changes on the CPU).
    ``split_bfloat16=True`` adds the product's lower block triangle straight into the float64 sum from bfloat16 GEMMs
    with exact products, `SPLIT_CHUNK_TOKENS` tokens at a time (`add_lower_split_gram_`: within 3·2⁻¹⁶ of
    Σ|y_i||y_j| beside the float32 sums' γ), on the tensor cores on CUDA, and mirrors it once when the sum is read;
    the batch's centre is then rounded to bfloat16, so that a bfloat16 activation less it is exact in the split for
    values within 2⁸ of it.
    """

    def __init__(
        self, dim: int, device: torch.device | str = "cpu", tf32: bool = False, split_bfloat16: bool = False
    ) -> None:
        super().__init__(tf32, split_bfloat16)
        self.sum = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        #: Whether entries above the diagonal blocks are stale until `_mirror` (a split product was added).
        self.lower_only = False

    def _home(self) -> torch.Tensor:
        return self.sum

    def _add(self, flat: torch.Tensor) -> None:
        n, dim = flat.shape
        if flat.dtype == torch.float64:
            flops.record(flops.gram(n, dim), "float64")
            self.sum.addmm_(flat.T, flat)
        else:
            total = float64_column_sum(flat)
            centre = self._centre(total, n)
            m = centre.double()
            if self.split:  # a chunk's centred copy at a time, its products added into the sum by bands
                for chunk in flat.split(SPLIT_CHUNK_TOKENS):
                    add_lower_split_gram_(self.sum, centred_float32(chunk, centre))
                self.lower_only = True
            else:
                centred = flat.float() - centre
                # In place: a float64 copy of the product or of an outer product would be another dim² matrix.
                if triangular_gram(self.sum.device) and not self.tf32:
                    product = mirror_lower_(add_lower_gram_(centred.new_zeros(dim, dim), centred))
                else:
                    flops.record(flops.gram(n, dim), flops.precision_of("float32", self.tf32))
                    with tf32_matmul(self.tf32 and self.sum.device.type == "cuda"):
                        product = centred.T @ centred
                self.sum.add_(product)
                del product, centred
            self.sum.addr_(m, total).addr_(total, m).addr_(m, m, alpha=-n)
        self.count += n

    def _mirror(self) -> None:
        """Fills the entries above the diagonal blocks from below, where split products left them stale."""
        if self.lower_only:
            mirror_lower_(self.sum, SPLIT_GRAM_BAND)
            self.lower_only = False

    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        self._mirror()
        return self.sum / self.count

    def finish(self) -> torch.Tensor:
        """The mean, computed in place in the running sum (which is consumed): one dim² matrix instead of two.

        Under a sharded calibration the sum and the count are first summed over the ranks (the statistic is complete
        only then)."""
        self._mirror()
        if is_sharded():
            all_reduce_(self.sum)
            (count,) = all_reduce_sums(self.count)
            self.count = int(count)
        if self.count == 0:
            raise ValueError("no calibration token reached this statistic (are all tokens masked?)")
        result, self.sum = self.sum.div_(self.count), None
        return result


class CentredSecondMoment(_MaskedMoment):
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

    ``split_bfloat16=True`` adds each chunk's product into a float64 scatter (twice the memory of the float32 one),
    its lower block triangle only, from bfloat16 GEMMs with exact products (`add_lower_split_gram_`), and mirrors
    it once in `finish`: each entry within (3·2⁻¹⁶ + 2⁻²³ + γ₃ₖ) Σ |y_i||y_j| of the float64 scatter
    (k = `chunk_tokens`; the float32 sums run over one chunk's three stacked parts only, where the float32
    scatter's run over every token), at the bfloat16 tensor cores' rate on CUDA. The centre is rounded to bfloat16,
    so that a bfloat16 activation within a factor 2⁷ of it splits exactly.
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str = "cpu",
        chunk_tokens: int = 4096,
        tf32: bool = False,
        split_bfloat16: bool = False,
    ) -> None:
        super().__init__(tf32, split_bfloat16)
        dtype = torch.float64 if split_bfloat16 else torch.float32
        self.scatter = torch.zeros(dim, dim, dtype=dtype, device=device)
        self.total = torch.zeros(dim, dtype=torch.float64, device=device)
        self.centre: torch.Tensor | None = None
        self.chunk_tokens = chunk_tokens
        #: The scatter holds its lower block triangle only until `finish` (`add_lower_gram_` on the CPU's float32
        #: path, `add_lower_split_gram_` on the split path), in bands of `band` columns.
        self.lower_only = split_bfloat16 or (not tf32 and triangular_gram(self.scatter.device))
        self.band = SPLIT_GRAM_BAND if split_bfloat16 else GRAM_BAND

    def _home(self) -> torch.Tensor:
        return self.scatter

    def _add(self, flat: torch.Tensor) -> None:
        n = flat.shape[0]
        total = float64_column_sum(flat, self.chunk_tokens)
        if self.centre is None:
            self.centre = self._centre(total, n)
        self.total.add_(total)
        if self.lower_only:  # the upper triangle is filled once, in `finish`
            add_lower = add_lower_split_gram_ if self.split else add_lower_gram_
            for chunk in flat.split(self.chunk_tokens):
                add_lower(self.scatter, centred_float32(chunk, self.centre), self.band)
            self.count += n
            return
        flops.record(flops.gram(n, flat.shape[1]), flops.precision_of("float32", self.tf32))
        with tf32_matmul(self.tf32 and self.scatter.device.type == "cuda"):
            for chunk in flat.split(self.chunk_tokens):
                centred = chunk.float() - self.centre
                self.scatter.addmm_(centred.T, centred)
        self.count += n

    def finish(self) -> CentredMoment:
        """The statistic as a `CentredMoment` (the running scatter is divided in place and handed over); under a
        sharded calibration, summed over the ranks first (`_all_reduce_`)."""
        if self.lower_only:  # before the ranks' sum, whose moves between centres touch every entry
            mirror_lower_(self.scatter, self.band)
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
    """C = S + μ μᵀ − δ δᵀ with S a float32 (float64 from the split path) (dim × dim) matrix and μ, δ float64
    vectors; read in float64 blocks.

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
        # Two slices leave a view of the scatter, which a float64 scatter (the split path's) would not copy in the
        # cast: the mean part added below would then change the statistic itself.
        result = part.to(torch.float64, copy=isinstance(rows, slice) and isinstance(cols, slice))
        result.addr_(self.mean[rows], self.mean[cols]).addr_(self.offset[rows], self.offset[cols], alpha=-1.0)
        return result

    def release(self) -> None:
        self.scatter = None
