"""The centred float32 cross moment (`CrossMoment(centred_float32=True)`, FlattenGPT's float32 statistics on the CPU)
against the float64 one, with its bound.

Each batch's sides are centred on their means rounded to float32 (two float32 roundings of each centred entry), a
chunk of k tokens is one float32 product (its sums: γₖ), and the chunks and the mean part add up in float64. So each
entry is within γₖ₊₂(float32) Σ|x_i − c_i||y_j − e_j| of the float64 moment, beside a few float64 roundings of
Σ|x_i||y_j|.
"""

from __future__ import annotations

import pytest
import torch

from common import assert_within, gamma
from optimum_flatten.calibration.stats import CROSS_BLOCK, CrossMoment


def _batches(offset: float, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """float32 activations with a common offset up to `offset` times their spread and one massive channel, targets
    mixed from them plus their own offset, and masks with padding in the second batch."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(64, 64, generator=generator) / 8
    scales = torch.logspace(0, 1, 64)
    xs, ys, masks = [], [], []
    for _ in range(3):
        x = (torch.randn(2, 80, 64, generator=generator) @ mix) * scales + offset
        x[..., 3] *= 50.0
        xs.append(x)
        ys.append(x @ (torch.randn(64, 24, generator=generator) / 8) + 3.0)
        masks.append(torch.ones(2, 80, dtype=torch.long))
    masks[1][1, 50:] = 0  # padding never reaches a sum
    return xs, ys, masks


@pytest.mark.parametrize("chunk", [48, 4096])
def test_the_centred_float32_cross_moment_is_within_its_bound_of_the_float64_one(chunk):
    xs, ys, masks = _batches(offset=40.0)
    fast = CrossMoment(64, 24, chunk_tokens=chunk, centred_float32=True)
    exact = CrossMoment(64, 24, chunk_tokens=chunk)
    for x, y, mask in zip(xs, ys, masks, strict=True):
        fast.update(x, y, mask)
        exact.update(x, y, mask)
    assert fast.count == exact.count == 3 * 160 - 30
    (s_fast, e_fast), (s_exact, e_exact) = fast.finish(), exact.finish()
    assert e_fast == pytest.approx(e_exact, rel=1e-14)  # the energy is float64 on both paths
    scale, plain, uncentred = (torch.zeros(64, 24, dtype=torch.float64) for _ in range(3))
    for x, y, mask in zip(xs, ys, masks, strict=True):
        keep = mask.reshape(-1).bool()
        a, b = x.reshape(-1, 64)[keep].double(), y.reshape(-1, 24)[keep].double()
        c, e = a.mean(0).float().double(), b.mean(0).float().double()
        scale += (a - c).abs().T @ (b - e).abs()
        plain += a.abs().T @ b.abs()
        uncentred += sum(u.float().T @ v.float() for u, v in zip(a.split(chunk), b.split(chunk), strict=True)).double()
    bound = (gamma(min(chunk, 160) + 2, torch.float32) * scale + gamma(8, torch.float64) * plain) / fast.count
    assert_within(s_fast, s_exact, bound, "centred float32 cross moment against float64")
    # The check can fail: the same float32 products without the centring are off by more than the bound here.
    assert not torch.all((uncentred / fast.count - s_exact).abs() <= bound)


def test_the_product_runs_by_blocks_of_output_columns_each_within_the_bound():
    """More output columns than `CROSS_BLOCK`: each block of columns is its own float32 product, and every entry of
    every block is within the bound of the float64 moment (a block written to the wrong columns would be off by the
    entries themselves). Not bit-equal to one product over all the columns: a BLAS may sum a narrow block in another
    order (torch 2.13's does on an AMD EPYC, by 2.9e-6 here)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, 16, generator=generator) + 2.0
    y = torch.randn(1, 64, CROSS_BLOCK + 5, generator=generator) - 1.0
    moment = CrossMoment(16, CROSS_BLOCK + 5, centred_float32=True)
    moment.update(x, y, None)
    a, b = x.reshape(64, 16).double(), y.reshape(64, -1).double()
    c, e = a.mean(0).float().double(), b.mean(0).float().double()
    bound = (
        gamma(64 + 2, torch.float32) * ((a - c).abs().T @ (b - e).abs())
        + gamma(8, torch.float64) * (a.abs().T @ b.abs())
    ) / 64
    assert_within(moment.finish()[0], a.T @ b / 64, bound, "blocks of output columns against float64")
    # The check can fail: the last block's columns read one place off.
    shifted = moment.finish()[0].clone()
    shifted[:, CROSS_BLOCK:] = shifted[:, CROSS_BLOCK - 1 : -1]
    assert not torch.all((shifted - a.T @ b / 64).abs() <= bound)


def test_one_path_at_a_time_and_float64_inputs_keep_the_float64_products():
    with pytest.raises(ValueError, match="not both"):
        CrossMoment(4, 2, split_bfloat16=True, centred_float32=True)
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(1, 30, 4, generator=generator).double(), torch.randn(1, 30, 2, generator=generator).double()
    fast, exact = CrossMoment(4, 2, centred_float32=True), CrossMoment(4, 2)
    fast.update(x, y, None)
    exact.update(x, y, None)
    assert torch.equal(fast.finish()[0], exact.finish()[0])
