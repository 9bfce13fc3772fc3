"""ops.ffn_alignment against naive references written plainly here (loops, float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

from common import assert_close
from optimum_flatten.ops.ffn_alignment import (
    MlpWeights,
    alignment_permutation,
    alignment_signals,
    average_mlps,
    correlation_from_sums,
    correlation_sums,
    feature_correlation,
    num_alignment_signals,
    permute_mlp_units,
)


def _naive_correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation, one pair of columns at a time, in float64."""
    x, y = x.double(), y.double()
    out = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
    for i in range(x.shape[1]):
        for j in range(y.shape[1]):
            a, b = x[:, i] - x[:, i].mean(), y[:, j] - y[:, j].mean()
            out[i, j] = (a * b).sum() / ((a * a).sum().sqrt() * (b * b).sum().sqrt())
    return out


def _features(n: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Large, different means and scales: the case where an uncentred float32 product would lose digits.
    return (torch.randn(n, d, generator=g) * torch.linspace(0.1, 5, d) + torch.linspace(-50, 50, d)).to(dtype)


def _naive_mlp(x: torch.Tensor, w: MlpWeights, act=torch.nn.functional.silu) -> torch.Tensor:
    up = x @ w.up_weight.T + (0 if w.up_bias is None else w.up_bias)
    if w.gate_weight is None:
        hidden = act(up)
    else:
        hidden = act(x @ w.gate_weight.T + (0 if w.gate_bias is None else w.gate_bias)) * up
    return hidden @ w.down_weight.T + (0 if w.down_bias is None else w.down_bias)


def _mlp(units: int = 7, hidden: int = 5, gated: bool = True, bias: bool = True, seed: int = 0) -> MlpWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return MlpWeights(
        up_weight=r(units, hidden),
        up_bias=r(units) if bias else None,
        gate_weight=r(units, hidden) if gated else None,
        gate_bias=r(units) if gated and bias else None,
        down_weight=r(hidden, units),
        down_bias=r(hidden) if bias else None,
    )


def test_correlation_matches_naive_float64():
    x, y = _features(200, 6, seed=0), _features(200, 5, seed=1)
    y = y + 0.5 * x[:, :5]  # some real correlation
    assert_close(feature_correlation(x, y), _naive_correlation(x, y))


def test_correlation_float32_inputs_within_float32_tolerance():
    x, y = _features(300, 6, seed=2), _features(300, 6, seed=3)
    y = y - 2.0 * x
    corr = feature_correlation(x.float(), y.float())
    assert corr.dtype == torch.float64
    assert_close(corr, _naive_correlation(x.float(), y.float()), dtype=torch.float32)


def test_batches_combine_exactly_into_the_whole():
    x, y = _features(120, 4, seed=4), _features(120, 3, seed=5)
    whole = correlation_sums(x, y)
    parts = correlation_sums(x[:17], y[:17]) + correlation_sums(x[17:80], y[17:80]) + correlation_sums(x[80:], y[80:])
    assert parts.count == whole.count
    for name in ("mean_x", "mean_y", "m2_x", "m2_y", "cross"):
        assert_close(getattr(parts, name), getattr(whole, name))
    empty = correlation_sums(x[:0], y[:0])
    assert_close((empty + whole).cross, whole.cross)
    with pytest.raises(ValueError, match="no calibration token"):
        correlation_from_sums(empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dead_neuron_correlates_zero_not_nan(dtype):
    x, y = _features(64, 4, seed=6, dtype=dtype), _features(64, 4, seed=7, dtype=dtype)
    x[:, 1] = 0.0  # a dead unit
    y[:, 2] = 3.7  # a constant unit with a large mean
    sums = correlation_sums(x[:30], y[:30]) + correlation_sums(x[30:], y[30:])
    corr = correlation_from_sums(sums)
    assert torch.isfinite(corr).all()
    assert torch.equal(corr[1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(corr[:, 2], torch.zeros(4, dtype=torch.float64))
    alive_x, alive_y = [0, 2, 3], [0, 1, 3]
    naive = _naive_correlation(x[:, alive_x], y[:, alive_y])
    assert_close(corr[alive_x][:, alive_y], naive, dtype=dtype)
    # The assignment still works with dead units present.
    assert sorted(alignment_permutation(feature_correlation(x, x)).tolist()) == [0, 1, 2, 3]


def test_assignment_recovers_an_exact_permutation():
    x = _features(500, 12, seed=8)
    true = torch.randperm(12, generator=torch.Generator().manual_seed(9))
    y = x[:, true]  # unit j of y is unit true[j] of x
    perm = alignment_permutation(feature_correlation(x, y))
    assert torch.equal(perm, torch.argsort(true))
    assert torch.equal(y[:, perm], x)


def test_assignment_maximises_like_brute_force():
    corr = torch.randn(6, 6, generator=torch.Generator().manual_seed(10), dtype=torch.float64).tanh()
    best = max(itertools.permutations(range(6)), key=lambda p: sum(float(corr[i, p[i]]) for i in range(6)))
    perm = alignment_permutation(corr)
    assert perm.tolist() == list(best)
    with pytest.raises(ValueError, match="square"):
        alignment_permutation(corr[:, :5])


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_permuting_units_is_function_preserving_and_pure(gated, bias):
    w = _mlp(gated=gated, bias=bias)
    before = {k: None if v is None else v.clone() for k, v in w.__dict__.items()}
    perm = torch.randperm(w.num_units, generator=torch.Generator().manual_seed(11))
    permuted = permute_mlp_units(w, perm)
    x = torch.randn(9, 5, dtype=torch.float64)
    assert_close(_naive_mlp(x, permuted), _naive_mlp(x, w))
    # Rows move together (naive loop), and the input is untouched.
    for new, old in enumerate(perm.tolist()):
        assert torch.equal(permuted.up_weight[new], w.up_weight[old])
        assert torch.equal(permuted.down_weight[:, new], w.down_weight[:, old])
        if gated:
            assert torch.equal(permuted.gate_weight[new], w.gate_weight[old])
    assert all(v is None or torch.equal(v, getattr(w, k)) for k, v in before.items())
    with pytest.raises(ValueError, match="permutation"):
        permute_mlp_units(w, torch.zeros(w.num_units, dtype=torch.long))


def test_average_matches_naive_mean_and_identical_members_are_identity():
    members = [_mlp(seed=s) for s in range(3)]
    mean = average_mlps(members)
    for name in ("up_weight", "up_bias", "gate_weight", "gate_bias", "down_weight", "down_bias"):
        naive = sum(getattr(m, name) for m in members) / 3
        assert_close(getattr(mean, name), naive)
    same = average_mlps([members[0]] * 4)
    assert all(torch.equal(getattr(same, k), getattr(members[0], k)) for k in members[0].__dict__)
    with pytest.raises(ValueError, match="different layouts"):
        average_mlps([members[0], _mlp(units=8)])
    with pytest.raises(ValueError, match="different layouts"):
        average_mlps([members[0], _mlp(gated=False)])


def test_aligned_average_of_permuted_copies_is_the_anchor():
    anchor = _mlp(units=10, seed=12)
    x = torch.randn(400, 5, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    members = [anchor]
    for seed in (14, 15):
        true = torch.randperm(10, generator=torch.Generator().manual_seed(seed))
        copy = permute_mlp_units(anchor, true)
        signals = [alignment_signals(x, w) for w in (anchor, copy)]
        corr = torch.stack([feature_correlation(a, b) for a, b in zip(*signals, strict=True)]).mean(0)
        members.append(permute_mlp_units(copy, alignment_permutation(corr)))
    merged = average_mlps(members)
    assert_close(_naive_mlp(x, merged), _naive_mlp(x, anchor))


def test_alignment_signals_are_the_first_linear_outputs_or_the_hidden():
    w = _mlp(seed=16)
    x = torch.randn(8, 5, dtype=torch.float64)
    gate, up = alignment_signals(x, w, "pre_activation")
    assert_close(gate, x @ w.gate_weight.T + w.gate_bias)
    assert_close(up, x @ w.up_weight.T + w.up_bias)
    (hidden,) = alignment_signals(x, w, "hidden", torch.nn.functional.silu)
    assert_close(hidden, torch.nn.functional.silu(gate) * up)
    plain = _mlp(gated=False, seed=17)
    (only,) = alignment_signals(x, plain, "pre_activation")
    assert_close(only, x @ plain.up_weight.T + plain.up_bias)
    with pytest.raises(ValueError, match="activation"):
        alignment_signals(x, w, "hidden")
    for mlp in (w, plain):
        for signal in ("pre_activation", "hidden"):
            signals = alignment_signals(x, mlp, signal, torch.nn.functional.silu)
            assert len(signals) == num_alignment_signals(mlp, signal)
