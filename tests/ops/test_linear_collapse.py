import pytest
import torch

from common import assert_close
from optimum_flatten.methods.layer_collapse import make_parametric_activation
from optimum_flatten.ops import (
    BatchNormStats,
    collapse_error,
    collapse_error_bound,
    collapse_linear_pair,
    fold_batchnorm_into_linear,
)

IN, HIDDEN, OUT = 5, 7, 4


def _linear(in_features, out_features, bias, seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).double()


def _batchnorm(features, seed, affine=True):
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.BatchNorm1d(features, affine=affine, eps=1e-3).double()
    with torch.no_grad():
        norm.running_mean.copy_(torch.randn(features, generator=g, dtype=torch.float64))
        norm.running_var.copy_(torch.rand(features, generator=g, dtype=torch.float64) + 0.5)
        if affine:
            norm.weight.copy_(torch.randn(features, generator=g, dtype=torch.float64))
            norm.bias.copy_(torch.randn(features, generator=g, dtype=torch.float64))
    return norm.eval()


def _naive_two_layer(x, w1, b1, w2, b2):
    """Loops over samples and features: y[n, o] = Σ_h w2[o, h]·(Σ_i w1[h, i]·x[n, i] + b1[h]) + b2[o]."""
    out = torch.zeros(x.shape[0], w2.shape[0], dtype=torch.float64)
    for n in range(x.shape[0]):
        hidden = [
            sum(w1[h, i] * x[n, i] for i in range(x.shape[1])) + (b1[h] if b1 is not None else 0.0)
            for h in range(w1.shape[0])
        ]
        for o in range(w2.shape[0]):
            out[n, o] = sum(w2[o, h] * hidden[h] for h in range(w1.shape[0])) + (b2[o] if b2 is not None else 0.0)
    return out


def _apply(x, weight, bias):
    return x @ weight.T + (bias if bias is not None else 0.0)


@pytest.mark.parametrize(("bias1", "bias2"), [(True, True), (False, False), (True, False), (False, True)])
def test_collapse_equals_the_linearised_two_layer_mlp(bias1, bias2):
    first, second = _linear(IN, HIDDEN, bias1, 0), _linear(HIDDEN, OUT, bias2, 1)
    mlp = torch.nn.Sequential(first, make_parametric_activation(torch.nn.GELU(), alpha=1.0).double(), second)
    x = torch.randn(6, IN, dtype=torch.float64)
    b1, b2 = first.bias, second.bias
    weight, bias = collapse_linear_pair(first.weight, b1, second.weight, b2)
    assert (bias is None) == (not bias1 and not bias2)
    with torch.no_grad():
        assert_close(_apply(x, weight, bias), mlp(x))
        assert_close(_apply(x, weight, bias), _naive_two_layer(x, first.weight, b1, second.weight, b2))


@pytest.mark.parametrize("placement", ["between", "after", "both"])
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_folds_exactly(placement, affine):
    first, second = _linear(IN, HIDDEN, True, 2), _linear(HIDDEN, OUT, placement != "after", 3)
    between = _batchnorm(HIDDEN, 4, affine) if placement in ("between", "both") else None
    after = _batchnorm(OUT, 5, affine) if placement in ("after", "both") else None
    identity = make_parametric_activation(torch.nn.ReLU(), alpha=1.0).double()
    layers = [first] + ([between] if between is not None else []) + [identity, second]
    layers += [after] if after is not None else []
    mlp = torch.nn.Sequential(*layers).eval()
    x = torch.randn(8, IN, dtype=torch.float64)
    weight, bias = collapse_linear_pair(
        first.weight,
        first.bias,
        second.weight,
        second.bias,
        between=None if between is None else BatchNormStats.from_module(between),
        after=None if after is None else BatchNormStats.from_module(after),
    )
    with torch.no_grad():
        assert_close(_apply(x, weight, bias), mlp(x))


def test_fold_batchnorm_into_linear_matches_the_module_and_does_not_mutate():
    linear, norm = _linear(IN, HIDDEN, False, 6), _batchnorm(HIDDEN, 7)
    weight = linear.weight.detach().clone()
    new_weight, new_bias = fold_batchnorm_into_linear(weight, None, BatchNormStats.from_module(norm))
    x = torch.randn(5, IN, dtype=torch.float64)
    with torch.no_grad():
        assert_close(_apply(x, new_weight, new_bias), norm(linear(x)))
    assert torch.equal(weight, linear.weight)


def test_batchnorm_in_training_mode_or_wrong_size_is_rejected():
    norm = _batchnorm(HIDDEN, 8).train()
    with pytest.raises(ValueError, match="eval"):
        BatchNormStats.from_module(norm)
    with pytest.raises(TypeError, match="BatchNorm"):
        BatchNormStats.from_module(torch.nn.LayerNorm(HIDDEN))
    stats = BatchNormStats.from_module(norm.eval())
    with pytest.raises(ValueError, match="features"):
        collapse_linear_pair(torch.randn(HIDDEN, IN), None, torch.randn(OUT, HIDDEN), None, after=stats)
    with pytest.raises(ValueError, match="chain"):
        collapse_linear_pair(torch.randn(HIDDEN, IN), None, torch.randn(OUT, HIDDEN + 1), None)


def test_float32_weights_are_merged_in_float64_and_cast_back():
    w1, w2 = torch.randn(HIDDEN, IN), torch.randn(OUT, HIDDEN)
    weight, bias = collapse_linear_pair(w1, None, w2, None)
    assert weight.dtype == torch.float32 and bias is None
    assert_close(weight, (w2.double() @ w1.double()).float())


@pytest.mark.parametrize("activation", [torch.nn.ReLU(), torch.nn.GELU(), torch.nn.SiLU()])
def test_error_is_zero_at_alpha_one_positive_otherwise_and_bounded(activation):
    first, second = _linear(IN, HIDDEN, True, 9), _linear(HIDDEN, OUT, True, 10)
    w1, b1, w2, b2 = first.weight.detach(), first.bias.detach(), second.weight.detach(), second.bias.detach()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 16, IN, generator=g, dtype=torch.float64)
    assert collapse_error_bound(x, w1, b1, w2, activation, 1.0) == 0
    assert collapse_error(x, w1, b1, w2, b2, activation, 1.0) < 1e-12
    previous = None
    for alpha in (0.0, 0.3, 0.9, 0.999):
        bound = collapse_error_bound(x, w1, b1, w2, activation, alpha)
        measured = collapse_error(x, w1, b1, w2, b2, activation, alpha, relative=False)
        relative = collapse_error(x, w1, b1, w2, b2, activation, alpha)
        assert measured > 0 and relative > 0
        assert measured <= bound * (1 + 1e-12)
        # The measured error is linear in (1 - α): it shrinks as α grows.
        if previous is not None:
            assert measured < previous
        previous = measured


def test_measured_error_matches_an_explicit_mlp_module():
    first, second = _linear(IN, HIDDEN, True, 12), _linear(HIDDEN, OUT, True, 13)
    activation = make_parametric_activation(torch.nn.GELU()).double()
    with torch.no_grad():
        activation.alpha.fill_(0.6)
    mlp = torch.nn.Sequential(first, activation, second)
    x = torch.randn(10, IN, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.linalg.vector_norm(
            mlp(x) - (x @ (second.weight @ first.weight).T + second.weight @ first.bias + second.bias)
        ) / torch.linalg.vector_norm(mlp(x))
    measured = collapse_error(
        x, first.weight, first.bias, second.weight, second.bias, activation.base, activation.current_alpha()
    )
    assert_close(measured, expected)
