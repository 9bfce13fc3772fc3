"""The float32 statistics path of FlattenGPT against the float64 reference, with the bounds it is held to.

- `CentredSecondMoment` (float32 scatter about a fixed centre, mean part exact in float64) against `SecondMoment`:
  every entry within 1e-5 of the largest centred entry, even when the tokens carry a common offset 100 times their
  spread (an uncentred float32 sum would lose the spread there);
- `ridge_leverage_scores_packed` (triangle-only factor): in float64 equal to `ridge_leverage_scores` to 1e-10; in
  float32 within 1e-5 (scores lie in [0, 1)) on activations with a massive channel, with the same top half;
- `kept_blocks` + `ridge_factor` + `nystrom_from_factor` equal `nystrom_down_correction` to 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch

from common import assert_within, gamma
from optimum_flatten.calibration import stats
from optimum_flatten.calibration.stats import CentredSecondMoment, SecondMoment, add_lower_gram_, mirror_lower_
from optimum_flatten.ops import top_k_indices
from optimum_flatten.ops.ridge import (
    default_ridge_lambda,
    kept_blocks,
    max_refined,
    nystrom_down_correction,
    nystrom_from_factor,
    ridge_factor,
    ridge_leverage_scores,
    ridge_leverage_scores_packed,
)


def _activations(dim: int = 300, batches: int = 4, offset: float = 3.0, seed: int = 0) -> list[torch.Tensor]:
    """Correlated, heavy-tailed float32 activations with a common offset and one massive channel."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=generator) / dim**0.5
    scales = torch.logspace(-2, 1, dim)
    out = []
    for _ in range(batches):
        x = (torch.randn(3, 100, dim, generator=generator) @ mix) * scales + offset
        x[..., 5] *= 200.0
        out.append(x)
    return out


def _both(xs: list[torch.Tensor], masks: list[torch.Tensor | None]):
    reference, centred = SecondMoment(xs[0].shape[-1]), CentredSecondMoment(xs[0].shape[-1], chunk_tokens=128)
    for x, m in zip(xs, masks, strict=True):
        reference.update(x.double(), m)
        centred.update(x, m)
    return reference.finish(), centred.finish()


@pytest.mark.parametrize("offset", [0.0, 3.0, 100.0])
def test_centred_float32_moment_matches_float64(offset):
    xs = _activations(offset=offset)
    masks = [None, torch.ones(3, 100), (torch.rand(3, 100, generator=torch.Generator().manual_seed(1)) > 0.3), None]
    reference, centred = _both(xs, masks)
    full = centred.block(slice(None), slice(None))
    flat = torch.cat(
        [
            x.reshape(-1, x.shape[-1])[m.reshape(-1).bool()] if m is not None else x.reshape(-1, 300)
            for x, m in zip(xs, masks, strict=True)
        ]
    ).double()
    spread = (flat - flat.mean(0)).T @ (flat - flat.mean(0)) / flat.shape[0]
    assert float((full - reference).abs().max()) <= 1e-5 * float(spread.abs().max())
    torch.testing.assert_close(centred.diagonal(), reference.diagonal(), rtol=1e-5, atol=0)
    rows, cols = torch.tensor([7, 3, 250]), torch.tensor([0, 299, 5, 5])
    # A block is the same three float64 terms per entry (scatter + mean outer product - offset outer product) as the
    # full matrix, but a vectorised kernel may fuse a multiply-add for some entries of one shape and not of another
    # (AVX-512 tails): each entry agrees to gamma_3 of the terms' magnitudes, not bit for bit.
    scatter = centred.scatter.double()[rows][:, cols].abs()
    mean_part = torch.outer(centred.mean[rows], centred.mean[cols]).abs()
    offset_part = torch.outer(centred.offset[rows], centred.offset[cols]).abs()
    bound = gamma(3, torch.float64) * (scatter + mean_part + offset_part)
    assert_within(centred.block(rows, cols), full[rows][:, cols], bound, "block vs slice of the full matrix")


def test_centred_moment_refuses_an_empty_statistic():
    moment = CentredSecondMoment(4)
    moment.update(torch.randn(1, 3, 4), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="no calibration token"):
        moment.finish()


def _scatter_reference(xs: list[torch.Tensor], centre: torch.Tensor, count: int):
    """The centred scatter M / n in float64, and Σ|y_i||y_j| / n (y = x - c), the scale every rounding bound takes."""
    y = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).double() - centre.double()
    return y.T @ y / count, y.abs().T @ y.abs() / count


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
)
def test_tf32_scatter_is_within_its_bound_and_restores_the_callers_precision(device):
    """TF32 rounds each input to 10 mantissa bits (by truncation on some hardware: relative error below 2^-10) and
    sums in float32, so each entry of the scatter is within (2·2^-10 + 2^-20 + γ_(n+2)) Σ|y_i||y_j| of the float64
    one (y = x - c; the two extra terms of γ cover the centring subtraction). On the CPU there is no TF32 and the
    option changes nothing, bit for bit."""
    xs = [x.to(device) for x in _activations(offset=3.0)]
    precision = torch.get_float32_matmul_precision()
    fast = CentredSecondMoment(300, device, chunk_tokens=128, tf32=True)
    plain = CentredSecondMoment(300, device, chunk_tokens=128)
    for x in xs:
        fast.update(x, None)
        plain.update(x, None)
    assert torch.get_float32_matmul_precision() == precision
    count = fast.count
    reference, scale = _scatter_reference([x.cpu() for x in xs], fast.centre.cpu(), count)
    bound = (2 * 2.0**-10 + 2.0**-20 + gamma(count + 2, torch.float32)) * scale + 2.0**-24 * reference.abs()
    assert_within(fast.scatter.cpu() / count, reference, bound, "TF32 scatter against float64")
    if device == "cpu":
        assert torch.equal(fast.scatter, plain.scatter)


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
)
def test_tf32_second_moment_is_within_its_bound(device):
    """`SecondMoment` centres each batch on its own mean: the TF32 product of batch b is within
    (2·2^-10 + 2^-20 + γ_(n_b+2)) Σ|y||y| (y = x - its batch mean), and the float64 mean part adds a few float64
    roundings of Σ|x||x|. On the CPU the option changes nothing, bit for bit."""
    xs = [x.to(device) for x in _activations(offset=3.0)]
    precision = torch.get_float32_matmul_precision()
    fast, plain = SecondMoment(300, device, tf32=True), SecondMoment(300, device)
    for x in xs:
        fast.update(x, None)
        plain.update(x, None)
    assert torch.get_float32_matmul_precision() == precision
    flats = [x.reshape(-1, 300).cpu().double() for x in xs]
    reference = sum(f.T @ f for f in flats)
    bound = sum(
        (2 * 2.0**-10 + 2.0**-20 + gamma(f.shape[0] + 2, torch.float32))
        * ((f - f.float().mean(0).double()).abs().T @ (f - f.float().mean(0).double()).abs())
        + gamma(8, torch.float64) * (f.abs().T @ f.abs())
        for f in flats
    )
    assert_within(fast.sum.cpu(), reference, bound, "TF32 second moment against float64")
    if device == "cpu":
        assert torch.equal(fast.sum, plain.sum)


@pytest.mark.parametrize("block_size", [64, 77, 1024])
def test_packed_leverage_matches_the_full_factor(block_size):
    reference, centred = _both(_activations(), [None] * 4)
    lam = default_ridge_lambda(reference, 10.0)
    expected = ridge_leverage_scores(reference, lam)

    def columns(start, stop):
        return reference[start:, start:stop]

    exact = ridge_leverage_scores_packed(columns, 300, lam, torch.float64, block_size)
    torch.testing.assert_close(exact, expected, rtol=0, atol=1e-10)

    def centred_columns(start, stop):
        return centred.block(slice(start, None), slice(start, stop))

    centred_lam = 10.0 * centred.trace() / 300
    fast = ridge_leverage_scores_packed(centred_columns, 300, centred_lam, torch.float32, block_size)
    assert float((fast - expected).abs().max()) <= 1e-5
    # Near-ties at the cut (neighbouring channels of this log-spaced spectrum) can swap in float32; refining the
    # channels near the cut in float64 gives the float64 path's kept set.
    refined = ridge_leverage_scores_packed(centred_columns, 300, centred_lam, torch.float32, block_size, 150)
    assert float((refined - expected).abs().max()) <= 1e-5
    assert set(top_k_indices(refined, 150)) == set(top_k_indices(expected, 150))
    distance = (fast - float(fast.topk(150).values[-1])).abs()
    near = distance.argsort()[: max_refined(300)]  # the channels re-scored: the nearest to the cut
    assert float((refined - expected)[near].abs().max()) <= 1e-9


def test_packed_leverage_adds_jitter_when_the_matrix_is_singular():
    """A rank-deficient C with λ = 0 fails the first factorisation; the jitter retry gives scores in [0, 1]."""
    x = torch.randn(50, 4, dtype=torch.float64)
    c = x @ x.T  # rank 4 of 50
    scores = ridge_leverage_scores_packed(lambda a, b: c[a:, a:b], 50, 0.0, torch.float64, 16)
    assert bool(((scores >= 0) & (scores <= 1)).all())
    assert float(scores.sum()) == pytest.approx(4.0, abs=0.05)


def test_blocked_nystrom_matches_the_full_correction():
    reference, centred = _both(_activations(), [None] * 4)
    lam = default_ridge_lambda(reference, 10.0)
    w = torch.randn(300, 40, dtype=torch.float32)
    keep = torch.tensor(top_k_indices(ridge_leverage_scores(reference, lam), 150))
    expected = nystrom_down_correction(reference, w, keep, lam)
    kept, cross = kept_blocks(lambda r, c: reference[r][:, c], 300, w, keep, chunk=37)
    result = nystrom_from_factor(ridge_factor(kept, lam), cross, w[keep])
    torch.testing.assert_close(result, expected, rtol=1e-10, atol=1e-12)
    kept, cross = kept_blocks(centred.block, 300, w, keep, chunk=64)
    result = nystrom_from_factor(ridge_factor(kept, 10.0 * centred.trace() / 300), cross, w[keep])
    assert float((result - expected).abs().max()) <= 1e-4 * float(expected.abs().max())


def test_lower_gram_is_the_full_products_lower_triangle_mirrored():
    """`add_lower_gram_` computes only the lower block triangle of yᵀy (each entry the dot product the full GEMM
    takes, float32 sums: within γₙ |y|ᵀ|y| of float64), leaves the entries above its diagonal blocks as they were
    until `mirror_lower_` copies the triangle onto them; a width that is no multiple of the band included."""
    generator = torch.Generator().manual_seed(3)
    y = torch.randn(90, 50, generator=generator) * torch.logspace(-2, 1, 50)
    out = torch.full((50, 50), 7.0)
    out.zero_()[:7, 7:] = -1.0  # the entries above the first diagonal block: untouched until mirrored
    add_lower_gram_(out, y, band=7)
    add_lower_gram_(out, y, band=7)  # accumulates
    assert bool((out[:7, 7:] == -1.0).all())
    mirror_lower_(out, band=7)
    assert torch.equal(out, out.T)
    exact = 2 * y.double().T @ y.double()
    assert_within(out, exact, gamma(91, torch.float32) * 2 * (y.abs().double().T @ y.abs().double()), "lower gram")


@pytest.mark.parametrize("triangular", [True, False], ids=["lower-triangle", "full-product"])
def test_float32_moments_are_the_same_with_the_triangular_gram(triangular, monkeypatch):
    """The CPU's triangular Gram path (`TRIANGULAR_GRAM_DEVICES`) in both float32 moments, with a band narrower than
    the statistic, is held to the bound of the full-product path against float64."""
    monkeypatch.setattr(stats, "GRAM_BAND", 64)
    monkeypatch.setattr(stats, "TRIANGULAR_GRAM_DEVICES", ("cpu",) if triangular else ())
    xs = _activations(offset=3.0)
    reference, centred = _both(xs, [None] * len(xs))
    full = centred.block(slice(None), slice(None))
    if triangular:  # the scatter mirrored: symmetric bit for bit
        assert torch.equal(centred.scatter, centred.scatter.T)
    flat = torch.cat([x.reshape(-1, 300) for x in xs]).double()
    spread = (flat - flat.mean(0)).T @ (flat - flat.mean(0)) / flat.shape[0]
    assert float((full - reference).abs().max()) <= 1e-5 * float(spread.abs().max())
    float32_path = SecondMoment(300)
    for x in xs:
        float32_path.update(x, None)
    assert float((float32_path.finish() - reference).abs().max()) <= 1e-5 * float(spread.abs().max())
