import torch

from common import assert_close
from optimum_flatten.ops import fold_norm_into_linear


def _naive(x_hat, weight, bias, gamma, beta):
    out = torch.zeros(x_hat.shape[0], weight.shape[0], dtype=torch.float64)
    for t in range(x_hat.shape[0]):
        normed = [gamma[i] * x_hat[t, i] + (beta[i] if beta is not None else 0.0) for i in range(x_hat.shape[1])]
        for o in range(weight.shape[0]):
            out[t, o] = sum(weight[o, i] * normed[i] for i in range(x_hat.shape[1])) + (
                bias[o] if bias is not None else 0.0
            )
    return out


def test_fold_rmsnorm_gain_matches_naive():
    g = torch.Generator().manual_seed(0)
    x_hat = torch.randn(5, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 6, generator=g, dtype=torch.float64)
    gamma = torch.randn(6, generator=g, dtype=torch.float64)
    new_weight, new_bias = fold_norm_into_linear(weight, None, gamma)
    assert new_bias is None
    assert_close(x_hat @ new_weight.T, _naive(x_hat, weight, None, gamma, None))


def test_fold_layernorm_with_bias_matches_naive():
    g = torch.Generator().manual_seed(1)
    x_hat = torch.randn(5, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    gamma = torch.randn(6, generator=g, dtype=torch.float64)
    beta = torch.randn(6, generator=g, dtype=torch.float64)
    new_weight, new_bias = fold_norm_into_linear(weight, bias, gamma, beta)
    assert_close(x_hat @ new_weight.T + new_bias, _naive(x_hat, weight, bias, gamma, beta))
    # A linear map without bias gets one when the norm has a bias.
    _, created = fold_norm_into_linear(weight, None, gamma, beta)
    assert_close(created, weight @ beta)


def test_fold_layernorm_module_end_to_end():
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(6).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    linear = torch.nn.Linear(6, 3).double()
    x = torch.randn(7, 6, dtype=torch.float64)
    expected = linear(norm(x))
    w, b = fold_norm_into_linear(linear.weight.data, linear.bias.data, norm.weight.data, norm.bias.data)
    plain = torch.nn.functional.layer_norm(x, (6,), eps=norm.eps)
    assert_close(plain @ w.T + b, expected)


def test_fold_does_not_mutate_inputs():
    weight = torch.randn(3, 4)
    gamma = torch.randn(4)
    copy_w, copy_g = weight.clone(), gamma.clone()
    fold_norm_into_linear(weight, None, gamma)
    assert torch.equal(weight, copy_w) and torch.equal(gamma, copy_g)
