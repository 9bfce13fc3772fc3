"""Running statistics over calibration tokens with padding masked: float64 sums, or a float32 centred scatter with
its mean part exact in float64."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..utils import flops
from .distributed import all_reduce_, all_reduce_sums, is_sharded, process_group

logger = logging.getLogger(__name__)


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


@contextmanager
def exact_bfloat16_reduction() -> Iterator[None]:
    """Within the block, cuBLAS may not reduce a bfloat16 GEMM's split-K partial sums in reduced precision (torch's
    default allows it): every partial sum stays float32, so a bfloat16 product accumulates as a float32 one does.
    The caller's setting is restored after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def split_bfloat16(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) bfloat16 with hi + lo = y to 2⁻¹⁶ |y| (hi = y rounded, lo = the float32 remainder rounded; the
    remainder is exact in float32). Exact when y has at most 16 significant bits, as the difference of two bfloat16
    numbers within a factor 2⁷ of each other has (8 bits each, at most 7 apart, one more for a carry)."""
    hi = y.bfloat16()
    return hi, (y - hi.float()).bfloat16()


def _float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bfloat16 `a` and `b` with float32 output and accumulation: on CUDA the tensor cores' bfloat16 GEMM
    (``out_dtype=float32``, partial sums kept in float32); elsewhere the same arithmetic in a float32 GEMM (a product
    of two bfloat16 numbers is exact in float32, so the two differ only in the order of the sums)."""
    global _FLOAT32_OUTPUT_MISSING
    if a.device.type == "cuda" and not _FLOAT32_OUTPUT_MISSING:
        try:
            with exact_bfloat16_reduction():
                return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as error:  # a torch before `mm(..., out_dtype)` (2.8)
            _FLOAT32_OUTPUT_MISSING = True
            logger.warning(
                "this torch has no bfloat16 GEMM with float32 output (%s); the split second moments run as float32 "
                "GEMMs (the same sums, without the tensor cores' speed)",
                error,
            )
    return a.float() @ b.float()


#: Set once a CUDA `torch.mm(..., out_dtype=float32)` has failed: the split products then run in float32 GEMMs.
_FLOAT32_OUTPUT_MISSING = False


def add_lower_split_gram_(out: torch.Tensor, y: torch.Tensor, band: int | None = None) -> torch.Tensor:
    """out += yᵀ y of a float32 (tokens × dim) `y` on its lower block triangle only (bands of `band` columns, the
    diagonal blocks whole; `mirror_lower_` with the same band fills the rest once), from bfloat16 GEMMs with exact
    products and float32 sums. Returns `out` (float64 on the callers' paths: each band's float32 product is added
    into it, so the float32 sums run over `y`'s rows only).

    With (hi, lo) = `split_bfloat16(y)`, yᵀy = hiᵀhi + hiᵀlo + loᵀhi + (loᵀlo and the split's remainder, below
    3·2⁻¹⁶ |y_i||y_j| per token together). The three terms are one symmetric GEMM, [hi; hi; lo]ᵀ [hi; lo; hi] (3n
    rows), so each band takes only the rows from its first column on: (dim + band)/(2·dim) of the square's products
    and of its float64 adds (0.55 at LLaMA-2-7B's merged MLP of 22,016 channels and bands of 2,048). Every entry
    computed is within (3·2⁻¹⁶ + γ₃ₙ) Σ_tokens |y_i||y_j| of the exact one (γ: the float32 sums of the 3n-term dot
    products), up to a (1 + 2⁻⁷) factor for lo's share of the sums.
    """
    n, dim = y.shape
    band = band or SPLIT_GRAM_BAND
    # One buffer [hi; hi; lo; hi] holds both sides: rows :3n are [hi; hi; lo], rows n: are [hi; lo; hi]. The parts
    # are written into it in place, with no concatenation, and are the ones `split_bfloat16` gives, bit for bit (the
    # copy into bfloat16 rounds as `.bfloat16()` does, and y − hi promotes hi exactly).
    stacked = torch.empty(4 * n, dim, dtype=torch.bfloat16, device=y.device)
    hi = stacked[:n]
    hi.copy_(y)
    stacked[2 * n : 3 * n].copy_(y - hi)
    stacked[n : 2 * n].copy_(hi)
    stacked[3 * n :].copy_(hi)
    return _add_lower_bands_(
        out, stacked[: 3 * n], stacked[n:], band, "bfloat16", lambda block, a, b: block.add_(_float32_product(a, b))
    )


def split_cross(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """xᵀ y of float32 (tokens × dim) `x` and (tokens × out) `y` from one bfloat16 GEMM with exact products and
    float32 sums: with (hi, lo) the `split_bfloat16` of each side, xᵀy = hiₓᵀhi_y + hiₓᵀlo_y + loₓᵀhi_y (+ loₓᵀlo_y and
    the splits' remainders, below 3·2⁻¹⁶ |x_i||y_j| per token together), the three as [hiₓ; hiₓ; loₓ]ᵀ [hi_y; lo_y;
    hi_y]. Each entry within (3·2⁻¹⁶ + γ₃ₙ) Σ_tokens |x_i||y_j| of the exact one."""
    hi_x, lo_x = split_bfloat16(x)
    left = torch.cat([hi_x, hi_x, lo_x])
    del hi_x, lo_x
    hi_y, lo_y = split_bfloat16(y)
    right = torch.cat([hi_y, lo_y, hi_y])
    del hi_y, lo_y
    flops.record(flops.product(x.shape[1], left.shape[0], y.shape[1]), "bfloat16")
    return _float32_product(left.T, right)


#: Devices whose float32 Gram products (`add_lower_gram_`) take only the lower block triangle of yᵀy, a band of
#: `GRAM_BAND` columns at a time, and mirror it once when the statistic is read: (d + b)/(2d) of the full product's
#: multiply-adds. On the CPU that is the time too (4,096 tokens x 3,072 channels, one thread: 0.46 -> 0.29 s, and the
#: lower triangle came out bit-identical to the full product's); on CUDA it is unmeasured, and the full product
#: (one GEMM launch) stays.
TRIANGULAR_GRAM_DEVICES = ("cpu",)
#: Columns per band of `add_lower_gram_`: narrow enough to skip most of the upper triangle, wide enough that each
#: band stays one efficient GEMM (384 to 768 timed within 5% of each other at 3,072 channels).
GRAM_BAND = 384
#: Columns per band of `add_lower_split_gram_` (the split bfloat16 path, on CUDA's tensor cores): each band's GEMM
#: is at least 2,048 columns by 3 × 4,096 token rows, the size at which an H100's bfloat16 GEMMs run near their rate,
#: and the skipped upper triangle is still 45% of the square at 22,016 channels (37.5% at 8,192).
SPLIT_GRAM_BAND = 2048
#: Tokens per split product: the float32 sums run over 3 × this many rows, and the stacked parts of one chunk
#: (8 bytes a value) are the path's largest temporary.
SPLIT_CHUNK_TOKENS = 4096


def triangular_gram(device: torch.device) -> bool:
    """Whether Gram products on `device` take the lower block triangle only (`TRIANGULAR_GRAM_DEVICES`)."""
    return device.type in TRIANGULAR_GRAM_DEVICES


def add_lower_gram_(out: torch.Tensor, y: torch.Tensor, band: int | None = None) -> torch.Tensor:
    """out += yᵀ y on its lower block triangle only: for each band of `band` columns, the rows from the band's first
    on (the diagonal block whole). Every entry computed is the dot product the full GEMM computes, with the same
    float32 sums; the entries above the diagonal blocks are left as they were, for `mirror_lower_` to fill once
    all the products are in (`band` None: `GRAM_BAND`, read at the call). Returns `out`."""
    return _add_lower_bands_(out, y, y, band or GRAM_BAND, "float32", lambda block, a, b: block.addmm_(a, b))


def _add_lower_bands_(
    out: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    band: int,
    precision: str,
    add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
) -> torch.Tensor:
    """For each band of `band` columns, `add(block, a, b)` adds a @ b to out's block from the band's first row on,
    with a = left[:, first:]ᵀ and b = right[:, band]: the lower block triangle of leftᵀ right, its diagonal blocks
    whole (what `add_lower_gram_` and `add_lower_split_gram_` share; the flops recorded in `precision`)."""
    dim = left.shape[1]
    for start in range(0, dim, band):
        stop = min(start + band, dim)
        flops.record(flops.product(dim - start, left.shape[0], stop - start), precision)
        add(out[start:, start:stop], left[:, start:].T, right[:, start:stop])
    return out


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


def float64_column_sum(flat: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Σ over rows in float64, `chunk_tokens` rows at a time: ``flat.sum(0, dtype=float64)`` casts the whole batch to
    float64 first (8 bytes a value: 2.7 GiB for one batch of 8 x 2048 tokens at LLaMA-2-7B's merged MLP width),
    where a chunk's cast is all the sum needs."""
    total = torch.zeros(flat.shape[-1], dtype=torch.float64, device=flat.device)
    for chunk in flat.split(chunk_tokens):
        total.add_(chunk.sum(dim=0, dtype=torch.float64))
    return total


def centred_float32(chunk: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """chunk.float() − centre (a float32 `centre`) in one pass where the chunk is a narrower float (the subtraction
    promotes it exactly); a float64 chunk is rounded to float32 first, as `.float()` does."""
    return chunk.float() - centre if chunk.dtype == torch.float64 else torch.sub(chunk, centre)


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


def batch_centre(total: torch.Tensor, n: int, split: bool) -> torch.Tensor:
    """The mean of `n` tokens summing to `total` in float32, rounded to bfloat16 on the split path (so that a bfloat16
    activation less it is exact in `split_bfloat16`): the one rule every centred statistic here rounds by."""
    centre = (total / n).float()
    return centre.bfloat16().float() if split else centre


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
