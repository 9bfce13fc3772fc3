"""Activations with one learnable linearity α that LayerCollapse trains towards the identity.

LayerCollapse (Shabgahi et al., "LayerCollapse: Adaptive Compression of Neural Networks", arXiv:2311.17943) makes the
activation between two linear layers learnably *less* nonlinear, then merges the two layers once it is linear:

- ReLU becomes a PReLU with one shared slope: ``max(0, x) + α·min(0, x)``.
- GELU becomes ``GELU^α(x) = x·(Φ(x) + α(1 − Φ(x)))`` (Φ the Gaussian CDF, or the tanh approximation of it for the
  ``gelu_new`` / ``gelu_pytorch_tanh`` GELU of GPT-2).
- SiLU becomes ``SiLU^α(x) = x·(σ(x) + α(1 − σ(x)))``.

All three are ``f(x) + α·(x − f(x))``, a blend of the pretrained activation f and the identity. The module computes
exactly that blend with ``torch.lerp(f(x), x, α)`` around the *original* activation module or function, which has two
consequences the paper's formulas written out would not have:

- α = 0 gives back f(x) bit for bit (lerp returns its start at weight 0), so attaching the activations changes no
  output of a pretrained model, whichever kernel f uses (erf GELU, tanh GELU, fused hub kernels).
- α = 1 gives back x bit for bit (lerp returns its end at weight 1), so a fully linearised MLP computes exactly the
  two linear maps that `ops.collapse_linear_pair` merges.

α parametrisation: α is stored as is (not through a sigmoid) and kept in [0, 1] by projection. A sigmoid can reach
neither 0 (the exact pretrained function at initialisation) nor 1 (exact collapse), and its gradient vanishes at both
ends, so the last 1e-4 before the collapse threshold would take a raw value near 9 and gradients shrunk by 1e-4. The
stored value is clamped in `forward` (so the function is always a member of the family, whatever an optimizer did) and
projected back into [0, 1] in place after every optimizer step (`project_`; `AdamLC` and `LayerCollapseTrainer` do it).
The clamp passes the gradient at the boundaries 0 and 1 themselves (`unit_interval`), so α still learns from its
initial value 0: ``torch.clamp`` did until torch 2.13, and gives 0 there from 2.14 on (the minimum-norm subgradient),
which would leave every α at 0 for good.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Activation families LayerCollapse can linearise, with the formula that α blends towards the identity.
FAMILIES: dict[str, str] = {
    "relu": "max(0,x) + α·min(0,x)",
    "gelu": "x·(Φ(x) + α(1 − Φ(x))), Φ the Gaussian CDF (erf)",
    "gelu_tanh": "x·(Φ̃(x) + α(1 − Φ̃(x))), Φ̃ the tanh approximation of the Gaussian CDF",
    "quick_gelu": "x·(σ(1.702x) + α(1 − σ(1.702x)))",
    "silu": "x·(σ(x) + α(1 − σ(x)))",
}

# transformers.activations class names by family. `GELUTanh` is the transformers 5 name of the tanh GELU;
# `PytorchGELUTanh` is its transformers 4 name, kept as an alias in 5.x. Missing names are skipped, so the table
# works across versions.
_TRANSFORMERS_CLASSES: dict[str, str] = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "SiLUActivation": "silu",
}


def unit_interval(alpha: torch.Tensor) -> torch.Tensor:
    """α clamped into [0, 1], with gradient 1 on the closed interval and 0 outside it, on every torch: from 2.14 on
    ``torch.clamp`` gives 0 at the bounds themselves, and α starts at its bound 0. The saved model's remote code
    (`remote_code.py`) writes the same formula."""
    inside = (alpha >= 0) & (alpha <= 1)
    return torch.where(inside, alpha, alpha.detach().clamp(0.0, 1.0))


class CollapseAlpha(nn.Parameter):
    """The parameter type of α, so that optimizers (`AdamLC`) can tell α from weights without names.

    A subclass survives `copy.deepcopy`, `module.to(...)` and `load_state_dict`, which attribute markers on a plain
    Parameter do not (deepcopy drops them, and the adapters copy blocks with deepcopy).
    """


# ---------------------------------------------------------------------------------------------- paper formulas
def gaussian_cdf(x: torch.Tensor) -> torch.Tensor:
    """Φ(x), the gate of the exact (erf) GELU: GELU(x) = x·Φ(x)."""
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def tanh_gaussian_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of Φ used by GPT-2's ``gelu_new``: 0.5·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def parametric_relu(x: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """The paper's PReLU form, ``max(0, x) + α·min(0, x)``, written out (reference; the module uses the blend)."""
    return x.clamp_min(0) + alpha * x.clamp_max(0)


def parametric_gelu(x: torch.Tensor, alpha: float | torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The paper's ``GELU^α(x) = x·(Φ(x) + α(1 − Φ(x)))``; ``approximate="tanh"`` uses the tanh Φ of GPT-2."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")
    phi = gaussian_cdf(x) if approximate == "none" else tanh_gaussian_cdf(x)
    return x * (phi + alpha * (1.0 - phi))


def parametric_silu(x: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """The paper's ``SiLU^α(x) = x·(σ(x) + α(1 − σ(x)))``."""
    gate = torch.sigmoid(x)
    return x * (gate + alpha * (1.0 - gate))


# ----------------------------------------------------------------------------------------------------- module
class ParametricActivation(nn.Module):
    """``f(x) + α·(x − f(x))`` around a pretrained activation f, with one learnable α in [0, 1].

    Build it with `make_parametric_activation`, which checks that f is one of the supported families. The wrapped
    activation is kept as the submodule (or attribute, for a plain function) ``base``; α is the parameter ``alpha``.

    Args:
        base: The original activation, called on the input; must not work in place.
        family: Key of `FAMILIES` naming what `base` computes.
        alpha: Initial α; 0 (the default) reproduces `base` exactly.
    """

    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], family: str, alpha: float = 0.0) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"unknown activation family {family!r}; allowed: {sorted(FAMILIES)}.")
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1] (0 = original activation, 1 = identity), got {alpha}.")
        self.family = family
        self.base = base
        self.alpha = CollapseAlpha(torch.tensor(float(alpha)))

    def current_alpha(self) -> torch.Tensor:
        """α as the forward uses it: the stored value clamped into [0, 1] (differentiable, `unit_interval`)."""
        return unit_interval(self.alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # lerp is exact at both ends: start at weight 0, end at weight 1.
        return torch.lerp(self.base(x), x, self.current_alpha().to(dtype=x.dtype, device=x.device))

    @torch.no_grad()
    def project_(self) -> None:
        """Moves the stored α back into [0, 1] after an optimizer step (projected gradient descent)."""
        self.alpha.clamp_(0.0, 1.0)

    def extra_repr(self) -> str:
        return f"family={self.family!r}, alpha={float(self.alpha.detach()):.6g}"


def parametric_activations(model: nn.Module) -> list[tuple[str, ParametricActivation]]:
    """Every ParametricActivation in `model` with its qualified name, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ParametricActivation)]


# ---------------------------------------------------------------------------------------------------- factory
def _transformers_module_families() -> dict[type, str]:
    try:
        from transformers import activations
    except ImportError:  # pragma: no cover - transformers is a hard dependency of the package
        return {}
    table = {}
    for name, family in _TRANSFORMERS_CLASSES.items():
        cls = getattr(activations, name, None)
        if cls is not None:
            table[cls] = family
    return table


def _module_family(module: nn.Module) -> str | None:
    """The family of a supported activation module (exact type match: a subclass may compute something else)."""
    kind = type(module)
    if kind is nn.ReLU:
        return "relu"
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _transformers_module_families().get(kind)


def _function_family(function: Callable) -> str | None:
    """The family of a supported plain function (torch's relu / gelu / silu, or a partial fixing gelu's mode)."""
    if isinstance(function, functools.partial) and not function.args:
        if function.func is F.gelu and set(function.keywords) <= {"approximate"}:
            return "gelu_tanh" if function.keywords.get("approximate", "none") == "tanh" else "gelu"
        if function.func in (F.relu, torch.relu, F.silu) and not function.keywords:
            return _function_family(function.func)
        return None
    if function in (F.relu, torch.relu):
        return "relu"
    if function is F.silu:
        return "silu"
    if function is F.gelu:
        return "gelu"
    return None


def _not_in_place(module: nn.Module) -> nn.Module:
    """A copy with ``inplace=False`` when the module would overwrite its input: the blend needs x and f(x) both."""
    if getattr(module, "inplace", False):
        module = copy.deepcopy(module)
        module.inplace = False
    return module


def _supported_summary() -> str:
    return (
        "torch.nn.ReLU, torch.nn.GELU (approximate 'none' or 'tanh'), torch.nn.SiLU, transformers.activations "
        "GELUActivation, NewGELUActivation, GELUTanh / PytorchGELUTanh, FastGELUActivation, QuickGELUActivation, "
        "SiLUActivation, the ACT2FN names 'relu', 'gelu', 'gelu_python', 'gelu_new', 'gelu_fast', "
        "'gelu_pytorch_tanh', 'gelu_python_tanh', 'quick_gelu', 'silu', 'swish', and the functions "
        "torch.nn.functional.relu / gelu / silu"
    )


def activation_family(activation: nn.Module | Callable | str) -> str | None:
    """The LayerCollapse family of an activation (module, function or ACT2FN name), or None when unsupported."""
    if isinstance(activation, str):
        activation = _resolve_name(activation, strict=False)
        if activation is None:
            return None
    if isinstance(activation, ParametricActivation):
        return None
    if isinstance(activation, nn.Module):
        return _module_family(activation)
    if callable(activation):
        return _function_family(activation)
    return None


def _resolve_name(name: str, strict: bool) -> nn.Module | None:
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        if strict:
            raise TypeError(
                f"unknown activation name {name!r}; LayerCollapse supports {_supported_summary()}. Pass one of "
                "those names or the activation module itself."
            )
        return None
    return ACT2FN[name]


def make_parametric_activation(activation: nn.Module | Callable | str, alpha: float = 0.0) -> ParametricActivation:
    """Wraps a pretrained activation into its LayerCollapse form, starting at α (0 = unchanged).

    Args:
        activation: An activation module, a torch function, or a transformers ACT2FN name such as ``"gelu_new"``.
        alpha: Initial α in [0, 1].

    Returns:
        A new `ParametricActivation` around the activation (an in-place module is copied with ``inplace=False``).

    Raises:
        TypeError: The activation is not one LayerCollapse can linearise (e.g. tanh, sigmoid, LeakyReLU, clipped
            GELU, or an already parametric activation); the message lists what is supported.
        ValueError: alpha outside [0, 1].
    """
    if isinstance(activation, ParametricActivation):
        raise TypeError(
            f"the activation is already a ParametricActivation (alpha={float(activation.alpha.detach()):.6g}); "
            "use it as it is instead of wrapping it twice."
        )
    if isinstance(activation, str):
        activation = _resolve_name(activation, strict=True)
    family = activation_family(activation)
    if family is None:
        raise TypeError(
            f"LayerCollapse cannot linearise an activation of type {type(activation).__name__} ({activation!r}); "
            f"supported: {_supported_summary()}. Activations that are not of the form x·gate(x) or ReLU have no "
            "parametric form in the paper; collapse such MLPs another way or leave them out."
        )
    if isinstance(activation, nn.Module):
        activation = _not_in_place(activation)
    return ParametricActivation(activation, family, alpha)


__all__ = [
    "FAMILIES",
    "CollapseAlpha",
    "ParametricActivation",
    "activation_family",
    "gaussian_cdf",
    "make_parametric_activation",
    "parametric_activations",
    "parametric_gelu",
    "parametric_relu",
    "parametric_silu",
    "tanh_gaussian_cdf",
]
