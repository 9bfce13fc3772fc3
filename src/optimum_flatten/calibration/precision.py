"""Reduced-precision products kept exact enough for the statistics: TF32 and bfloat16 GEMMs switched on only inside
a statistic, the split of float32 values into bfloat16 (hi, lo) pairs whose products are exact, the banded lower
triangle of a Gram product, and the float64 sums and centring that keep a float32 product's error relative to the
scatter. Apart from the moments (`stats.py`, `cross_moment.py`) that use them because each is an arithmetic rule with
its own error bound (tests/calibration/test_split_moments.py), whatever statistic it serves."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..utils import flops

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


#: Columns per band of `add_lower_split_gram_` (the split bfloat16 path, on CUDA's tensor cores): each band's GEMM
#: is at least 2,048 columns by 3 × 4,096 token rows, the size at which an H100's bfloat16 GEMMs run near their rate,
#: and the skipped upper triangle is still 45% of the square at 22,016 channels (37.5% at 8,192).
SPLIT_GRAM_BAND = 2048


#: Tokens per split product: the float32 sums run over 3 × this many rows, and the stacked parts of one chunk
#: (8 bytes a value) are the path's largest temporary.
SPLIT_CHUNK_TOKENS = 4096


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
    return add_lower_bands_(
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


def add_lower_bands_(
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


def batch_centre(total: torch.Tensor, n: int, split: bool) -> torch.Tensor:
    """The mean of `n` tokens summing to `total` in float32, rounded to bfloat16 on the split path (so that a bfloat16
    activation less it is exact in `split_bfloat16`): the one rule every centred statistic here rounds by."""
    centre = (total / n).float()
    return centre.bfloat16().float() if split else centre
