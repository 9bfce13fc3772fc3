"""Second moments from split bfloat16 products (`covariance_dtype="bfloat16"`) against float64, with their bound.

A product of two bfloat16 numbers is exact in float32. Each centred activation y = x − c (float32) is split into
two bfloat16 parts, hi + lo = y to 2⁻¹⁶|y| (exactly when y has at most 16 significant bits, as the difference of a
bfloat16 activation and the bfloat16 centre within a factor 2⁷ of it does), and `add_lower_split_gram_` takes every
cross term but lo·loᵀ from one stacked GEMM ([hi; hi; lo]ᵀ [hi; lo; hi]) per band of the lower block triangle, with
exact products and float32 sums over one chunk of tokens; the chunks add up in float64 and the triangle is mirrored
once. So each entry is within (3·2⁻¹⁶ + 2⁻²³ + γ₃ₖ(float32)) Σ|y_i||y_j| of the float64 scatter (k tokens a chunk),
up to a (1 + 2⁻⁷) factor for lo's share of the sums. On the CPU the same arithmetic runs in float32 GEMMs (the
products are exact either way); on CUDA it runs on the bfloat16 tensor cores (the `gpu` cases).
"""

from __future__ import annotations

import time

import pytest
import torch

from common import assert_within, gamma
from optimum_flatten.calibration.stats import (
    CentredSecondMoment,
    CrossMoment,
    SecondMoment,
    add_lower_split_gram_,
    centred_float32,
    exact_bfloat16_reduction,
    mirror_lower_,
    split_bfloat16,
    split_cross,
)

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _split_bound(chunk: int) -> float:
    return (1 + 2.0**-7) * (3 * 2.0**-16 + 2.0**-23 + gamma(3 * chunk, torch.float32))


def _activations(dim: int = 96, batches: int = 3, offset: float = 40.0, seed: int = 0) -> list[torch.Tensor]:
    """bfloat16 activations with a common offset up to 40 times their spread and one massive channel (the case
    centring is for: an uncentred float32 sum loses the spread), every channel still varying in bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=generator) / dim**0.5
    scales = torch.logspace(0, 1, dim)
    out = []
    for _ in range(batches):
        x = (torch.randn(2, 80, dim, generator=generator) @ mix) * scales + offset
        x[..., 3] *= 50.0
        out.append(x.bfloat16())
    return out


def test_the_split_is_exact_near_the_centre_and_within_two_to_the_minus_sixteen_elsewhere():
    generator = torch.Generator().manual_seed(0)
    centre = (torch.rand(64, generator=generator) * 10 + 1).bfloat16().float()
    near = (centre * (1 + (torch.rand(500, 64, generator=generator) - 0.5) * 1.9)).bfloat16().float()  # within 2⁷
    hi, lo = split_bfloat16(near - centre)
    assert torch.equal(hi.float() + lo.float(), near - centre)
    y = torch.randn(500, 64, generator=generator) * torch.logspace(-6, 6, 64)
    hi, lo = split_bfloat16(y)
    assert_within(hi.double() + lo.double(), y, 2.0**-16 * y.abs().double(), "hi + lo against y")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("band", [7, 16, 48, 64])
def test_the_lower_split_gram_is_within_its_bound_and_leaves_the_upper_triangle(device, band):
    """Each band adds only the rows from its first column on: above the diagonal blocks the matrix is untouched
    (NaN stays NaN) until `mirror_lower_` with the same band fills it, and then it is symmetric and within the bound
    everywhere. A band that does not divide the width (7, 16 of 48 with a ragged last band: 48 is a multiple) and one
    wider than it (64: one band, the whole square) are covered."""
    generator = torch.Generator().manual_seed(1)
    y = torch.randn(300, 48, generator=generator) * torch.logspace(-3, 2, 48)
    out = torch.full((48, 48), float("nan"), dtype=torch.float64, device=device)
    for start in range(0, 48, band):
        out[start:, start : start + band] = 0.0  # what the callers' zeros are, below and on the diagonal blocks
    add_lower_split_gram_(out, y.to(device), band)
    for start in range(0, 48, band):
        assert bool(out[:start, start : start + band].isnan().all())  # above: untouched
        assert not bool(out[start:, start : start + band].isnan().any())
    result = mirror_lower_(out, band).cpu()
    exact = y.double().T @ y.double()
    assert_within(result, exact, _split_bound(300) * (y.abs().double().T @ y.abs().double()), "lower split gram")
    assert torch.equal(result, result.T)


@pytest.mark.parametrize("device", DEVICES)
def test_split_scatter_is_within_its_bound_and_keeps_the_callers_reduction_setting(device):
    """`CentredSecondMoment(split_bfloat16=True)` against the float64 scatter about its (bfloat16) centre. The check
    can fail: the uncentred bfloat16 GEMM (products exact too, but of x instead of x − c) with the mean part taken
    out in float64 afterwards is off by more than the bound here (about 4 times), and TF32's bound is 40 times it."""
    setting = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    xs = [x.to(device) for x in _activations()]
    chunk = 64
    fast = CentredSecondMoment(96, device, chunk_tokens=chunk, split_bfloat16=True)
    for x in xs:
        fast.update(x, None)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == setting
    count, centre = fast.count, fast.centre.cpu()
    assert torch.equal(centre.bfloat16().float(), centre)
    moment = fast.finish()
    assert moment.scatter.dtype == torch.float64
    flat = torch.cat([x.cpu().reshape(-1, 96) for x in xs]).double()
    y = flat - centre.double()
    reference, scale = y.T @ y / count, y.abs().T @ y.abs() / count
    assert_within(moment.scatter.cpu(), reference, _split_bound(chunk) * scale, "split scatter against float64")
    # The statistic it hands on: C = E[x xᵀ] in float64 blocks, as the float32 scatter's.
    assert_within(
        moment.block(slice(None), slice(None)).cpu(),
        flat.T @ flat / count,
        _split_bound(chunk) * scale + gamma(8, torch.float64) * (flat.abs().T @ flat.abs() / count),
        "C against float64",
    )
    uncentred = sum(c.float().T @ c.float() for c in flat.float().split(chunk)).double() / count
    mean = flat.mean(0)
    error = (
        uncentred - torch.outer(mean, mean) - (reference - torch.outer(mean - centre.double(), mean - centre.double()))
    )
    assert bool((scale.diagonal() > 0).all())  # every channel varies: no entry of the bound is zero
    assert float((error.abs() / (_split_bound(chunk) * scale)).max()) > 1  # beyond the bound
    assert float((moment.scatter.cpu() - reference).abs().max()) < 2.0**-10 * float(scale.max())


@pytest.mark.parametrize("device", DEVICES)
def test_split_second_moment_is_within_its_bound(device):
    """`SecondMoment(split_bfloat16=True)` (the o_proj input's moment) centres each batch on its own mean rounded to
    bfloat16 and adds the split product to a float64 sum: batch b within the split bound of Σ|y||y| (y = x − its
    centre), and the float64 mean part adds a few float64 roundings of Σ|x||x|."""
    xs = [x.to(device) for x in _activations(offset=3.0)]
    fast = SecondMoment(96, device, split_bfloat16=True)
    for x in xs:
        fast.update(x, None)
    flats = [x.reshape(-1, 96).cpu().double() for x in xs]
    reference = sum(f.T @ f for f in flats)
    bound = 0.0
    for f in flats:
        centre = f.sum(0).div(f.shape[0]).float().bfloat16().double()
        y = (f - centre).abs()
        bound = bound + _split_bound(f.shape[0]) * (y.T @ y) + gamma(8, torch.float64) * (f.abs().T @ f.abs())
    assert_within(fast.sum.cpu(), reference, bound, "split second moment against float64")


def test_one_precision_at_a_time():
    with pytest.raises(ValueError, match="not both"):
        CentredSecondMoment(4, tf32=True, split_bfloat16=True)
    with pytest.raises(ValueError, match="not both"):
        SecondMoment(4, tf32=True, split_bfloat16=True)


@pytest.mark.gpu
def test_split_scatter_runs_at_tensor_core_speed_on_cuda():
    """At a merged pair's MLP width of LLaMA-2-7B's scale (8192 here, 16 batches of 4096 tokens), the split
    bfloat16 scatter takes less time than the float32 one: two bfloat16 GEMMs against one float32 GEMM on the CUDA
    cores (about 8× the rate at the datasheets' peaks)."""
    dim, device = 8192, "cuda"
    batches = [torch.randn(1, 4096, dim, device=device, dtype=torch.bfloat16) + 3 for _ in range(16)]

    def timed(moment) -> float:
        moment.update(batches[0], None)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x in batches:
            moment.update(x, None)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    split = timed(CentredSecondMoment(dim, device, split_bfloat16=True))
    plain = timed(CentredSecondMoment(dim, device))
    assert split < 0.6 * plain, (split, plain)


def _cross_bound(tokens: int) -> float:
    return (1 + 2.0**-7) * (3 * 2.0**-16 + gamma(3 * tokens, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_split_cross_is_within_its_bound(device):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(300, 40, generator=generator) * torch.logspace(-3, 2, 40)
    y = torch.randn(300, 24, generator=generator) * torch.logspace(1, -2, 24)
    result = split_cross(x.to(device), y.to(device)).cpu()
    exact = x.double().T @ y.double()
    assert result.dtype == torch.float32
    assert_within(result, exact, _cross_bound(300) * (x.abs().double().T @ y.abs().double()), "split_cross")


@pytest.mark.parametrize("device", DEVICES)
def test_split_cross_moment_is_within_its_bound_of_the_float64_one_with_padding(device):
    """`CrossMoment(split_bfloat16=True)` (FlattenGPT's sequential targets under covariance_dtype="bfloat16")
    against the float64 `CrossMoment` on the same activations and targets: each batch centred on its
    bfloat16-rounded means, the mean part added back in float64, so the bound is relative to Σ|x − c||y − e|. The
    check can fail: without the centring the same split arithmetic is off by more than the bound here (the
    activations carry a common offset up to 40 times their spread)."""
    generator = torch.Generator().manual_seed(5)
    # float32 activations (a bfloat16 model's would split exactly) with the common offset centring is for.
    xs = [(x.float() * (1 + 1e-3 * torch.randn(x.shape, generator=generator))).to(device) for x in _activations(dim=64)]
    mix = torch.randn(64, 24, generator=generator) / 8
    ys = [x @ mix.to(device) + 3.0 for x in xs]
    masks = [torch.ones(2, 80, dtype=torch.long, device=device) for _ in xs]
    masks[1][1, 50:] = 0  # padding never reaches a sum
    chunk = 48
    fast, exact = CrossMoment(64, 24, device, chunk, split_bfloat16=True), CrossMoment(64, 24, device, chunk)
    for x, y, mask in zip(xs, ys, masks, strict=True):
        fast.update(x, y, mask)
        exact.update(x, y, mask)
    assert fast.count == exact.count == 3 * 160 - 30
    (s_fast, e_fast), (s_exact, e_exact) = fast.finish(), exact.finish()
    assert e_fast == pytest.approx(e_exact, rel=1e-14)
    scale, plain, uncentred = (torch.zeros(64, 24, dtype=torch.float64) for _ in range(3))
    for x, y, mask in zip(xs, ys, masks, strict=True):
        keep = mask.cpu().reshape(-1).bool()
        a, b = x.cpu().reshape(-1, 64)[keep].double(), y.cpu().reshape(-1, 24)[keep].double()
        c, e = a.mean(0).float().bfloat16().double(), b.mean(0).float().bfloat16().double()
        scale += (a - c).abs().T @ (b - e).abs()
        plain += a.abs().T @ b.abs()
        pairs = zip(a.split(chunk), b.split(chunk), strict=True)
        uncentred += sum(split_cross(u.float(), v.float()).double() for u, v in pairs)
    bound = _cross_bound(chunk) * scale / fast.count + gamma(8, torch.float64) * plain / fast.count
    assert_within(s_fast.cpu(), s_exact.cpu(), bound, "split cross moment against float64")
    assert not torch.all((uncentred / fast.count - s_exact.cpu()).abs() <= bound)


@pytest.mark.parametrize("device", DEVICES)
def test_the_stacked_buffer_holds_split_bfloat16s_parts_bit_for_bit(device):
    """`add_lower_split_gram_` writes hi and lo in place into one [hi; hi; lo; hi] buffer instead of concatenating
    `split_bfloat16`'s parts: every band's product is the one of the concatenated [hi; hi; lo]ᵀ [hi; lo; hi], bit for
    bit (the same operands, the same GEMM)."""
    generator = torch.Generator().manual_seed(6)
    y = (torch.randn(64, 40, generator=generator) * torch.logspace(-3, 3, 40)).to(device)
    out = add_lower_split_gram_(torch.zeros(40, 40, dtype=torch.float64, device=device), y, 16)
    hi, lo = split_bfloat16(y)
    left, right = torch.cat([hi, hi, lo]), torch.cat([hi, lo, hi])
    for start in range(0, 40, 16):
        a, b = left[:, start:].T, right[:, start : start + 16]
        with exact_bfloat16_reduction():
            product = torch.mm(a, b, out_dtype=torch.float32) if device == "cuda" else a.float() @ b.float()
        assert torch.equal(out[start:, start : start + 16], product.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_centring_a_chunk_in_one_pass_is_the_cast_then_the_subtraction(dtype):
    generator = torch.Generator().manual_seed(7)
    centre = torch.randn(9, generator=generator)
    chunk = (torch.randn(30, 9, generator=generator) * 5).to(dtype)
    result = centred_float32(chunk, centre)
    assert result.dtype == torch.float32
    assert torch.equal(result, chunk.float() - centre)
