import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import activations as hf_act

from common import assert_close
from optimum_flatten.methods.layer_collapse.activation import (
    CollapseAlpha,
    ParametricActivation,
    activation_family,
    make_parametric_activation,
    parametric_gelu,
    parametric_relu,
    parametric_silu,
)

# (activation, family). Every kind the factory accepts, GPT-2's tanh GELU ("gelu_new") included.
SUPPORTED = [
    (torch.nn.ReLU(), "relu"),
    (torch.nn.ReLU(inplace=True), "relu"),
    (torch.nn.GELU(), "gelu"),
    (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
    (torch.nn.SiLU(), "silu"),
    (torch.nn.SiLU(inplace=True), "silu"),
    (hf_act.GELUActivation(), "gelu"),
    (hf_act.GELUActivation(use_gelu_python=True), "gelu"),
    (hf_act.NewGELUActivation(), "gelu_tanh"),
    (hf_act.GELUTanh(), "gelu_tanh"),
    (hf_act.PytorchGELUTanh(), "gelu_tanh"),
    (hf_act.GELUTanh(use_gelu_tanh_python=True), "gelu_tanh"),
    (hf_act.FastGELUActivation(), "gelu_tanh"),
    (hf_act.QuickGELUActivation(), "quick_gelu"),
    (hf_act.SiLUActivation(), "silu"),
    ("gelu_new", "gelu_tanh"),
    ("gelu_pytorch_tanh", "gelu_tanh"),
    ("gelu", "gelu"),
    ("relu", "relu"),
    ("silu", "silu"),
    ("swish", "silu"),
    (F.relu, "relu"),
    (torch.relu, "relu"),
    (F.gelu, "gelu"),
    (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh"),
    (F.silu, "silu"),
]
IDS = [f"{type(a).__name__ if not isinstance(a, str) else a}-{i}" for i, (a, _) in enumerate(SUPPORTED)]


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 9, generator=g, dtype=dtype) * 3
    x[0, 0, :3] = torch.tensor([0.0, -0.0, 1e-8], dtype=dtype)
    return x


def _original(activation):
    if isinstance(activation, str):
        return hf_act.ACT2FN[activation]
    return activation


def _reference(activation, x):
    """The original activation on a fresh copy of x (in-place modules must not see x itself)."""
    return _original(activation)(x.clone())


@pytest.mark.parametrize(("activation", "family"), SUPPORTED, ids=IDS)
def test_alpha_zero_is_the_original_activation_bit_for_bit(activation, family):
    x = _inputs()
    module = make_parametric_activation(activation)
    assert module.family == family
    assert module.alpha.item() == 0.0
    out = module(x)
    assert torch.equal(out, _reference(activation, x))


@pytest.mark.parametrize(("activation", "family"), SUPPORTED, ids=IDS)
def test_alpha_one_is_the_identity_bit_for_bit(activation, family):
    x = _inputs()
    module = make_parametric_activation(activation, alpha=1.0)
    before = x.clone()
    assert torch.equal(module(x), before)
    assert torch.equal(x, before), "the input must not be modified (in-place activations are copied)"


def _naive(family, x, alpha):
    """The paper's formulas written independently, element by element, in float64."""
    out = torch.empty_like(x)
    flat_in, flat_out = x.reshape(-1), out.view(-1)
    for i, v in enumerate(flat_in.tolist()):
        if family == "relu":
            value = max(0.0, v) + alpha * min(0.0, v)
        else:
            if family == "gelu":
                gate = 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))
            elif family == "gelu_tanh":
                gate = 0.5 * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
            elif family == "quick_gelu":
                gate = 1.0 / (1.0 + math.exp(-1.702 * v))
            else:
                gate = 1.0 / (1.0 + math.exp(-v))
            value = v * (gate + alpha * (1.0 - gate))
        flat_out[i] = value
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.75, 1.0])
@pytest.mark.parametrize(
    ("activation", "family"),
    [
        (torch.nn.ReLU(), "relu"),
        (torch.nn.GELU(), "gelu"),
        (hf_act.NewGELUActivation(), "gelu_tanh"),
        (hf_act.QuickGELUActivation(), "quick_gelu"),
        (torch.nn.SiLU(), "silu"),
    ],
)
def test_blend_matches_the_paper_formula_in_float64(activation, family, alpha):
    x = _inputs(torch.float64)[:2]
    module = make_parametric_activation(activation).double()
    with torch.no_grad():
        module.alpha.fill_(alpha)  # set in float64: a float32 0.3 is not 0.3
    assert_close(module(x), _naive(family, x, alpha))


def test_written_out_formulas_match_the_naive_reference():
    x = _inputs(torch.float64)[:2]
    for alpha in (0.0, 0.4, 1.0):
        assert_close(parametric_relu(x, alpha), _naive("relu", x, alpha))
        assert_close(parametric_gelu(x, alpha), _naive("gelu", x, alpha))
        assert_close(parametric_gelu(x, alpha, approximate="tanh"), _naive("gelu_tanh", x, alpha))
        assert_close(parametric_silu(x, alpha), _naive("silu", x, alpha))


def test_gradient_reaches_alpha_from_its_initial_value_zero():
    x = _inputs(torch.float64)
    module = make_parametric_activation(torch.nn.GELU()).double()
    upstream = torch.randn_like(x)
    (module(x) * upstream).sum().backward()
    expected = ((x - F.gelu(x)) * upstream).sum()
    assert module.alpha.grad is not None
    assert_close(module.alpha.grad, expected)
    assert module.alpha.grad.abs() > 0


def test_alpha_stays_in_unit_interval_after_steps_that_push_it_out():
    x = _inputs()
    relu = make_parametric_activation(torch.nn.ReLU(), alpha=0.5)
    optimizer = torch.optim.SGD(relu.parameters(), lr=100.0)
    for sign in (+1.0, -1.0):  # push far above 1, then far below 0
        optimizer.zero_grad()
        (sign * -relu.alpha * 10).backward()  # gradient -10·sign: SGD moves α by +1000·sign
        optimizer.step()
        assert not 0.0 <= relu.alpha.item() <= 1.0, "the step did push the stored value out"
        assert 0.0 <= relu.current_alpha().item() <= 1.0
        clamped = 1.0 if sign > 0 else 0.0
        assert torch.equal(relu(x), make_parametric_activation(torch.nn.ReLU(), alpha=clamped)(x))
        relu.project_()
        assert relu.alpha.item() == clamped


def test_gpt2_logits_are_unchanged_after_attaching_at_alpha_zero():
    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, activation_function="gelu_new")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        before = model(ids).logits
    for block in model.transformer.h:
        assert activation_family(block.mlp.act) == "gelu_tanh"
        block.mlp.act = make_parametric_activation(block.mlp.act)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    "activation",
    [
        torch.nn.Tanh(),
        torch.nn.LeakyReLU(0.1),
        torch.nn.Sigmoid(),
        hf_act.ClippedGELUActivation(-10, 10),
        "tanh",
        "not_an_activation",
        torch.tanh,
        lambda x: x * 2,
        functools.partial(F.gelu, approximate="tanh", bogus=1),
    ],
)
def test_unsupported_activations_raise_a_clear_type_error(activation):
    with pytest.raises(TypeError, match=r"supports|supported"):
        make_parametric_activation(activation)


def test_wrapping_twice_and_bad_alpha_are_rejected():
    module = make_parametric_activation(torch.nn.ReLU(), alpha=0.25)
    with pytest.raises(TypeError, match="already a ParametricActivation"):
        make_parametric_activation(module)
    assert activation_family(module) is None
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        make_parametric_activation(torch.nn.ReLU(), alpha=1.5)
    with pytest.raises(ValueError, match="family"):
        ParametricActivation(torch.nn.ReLU(), "tanh")


def test_alpha_keeps_its_type_through_deepcopy_and_dtype_moves():
    module = make_parametric_activation(torch.nn.GELU(), alpha=0.2)
    for other in (copy.deepcopy(module), module.double()):
        assert isinstance(other.alpha, CollapseAlpha)
    assert "alpha=0.2" in repr(module)


@pytest.mark.parametrize(("stored", "gradient"), [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (-0.25, 0.0), (1.25, 0.0)])
def test_alpha_has_gradient_one_on_the_closed_interval_and_zero_outside_on_every_torch(stored, gradient):
    # torch.clamp gives 0 at the bounds themselves from torch 2.14 on; alpha starts at the bound 0.
    from optimum_flatten.methods.layer_collapse.activation import unit_interval

    alpha = torch.tensor(stored, requires_grad=True)
    value = unit_interval(alpha)
    value.backward()
    assert float(value) == min(max(stored, 0.0), 1.0)
    assert float(alpha.grad) == gradient
