"""Merging two linear maps whose activation became the identity, and how wrong the merge is before that.

Once LayerCollapse has trained an MLP's activation to α = 1 the MLP is ``W2·(W1·x + b1) + b2``, which is the single
map ``W·x + b`` with ``W = W2·W1`` and ``b = W2·b1 + b2``. Eval-mode BatchNorm between or after the two maps is a
per-feature affine map too and folds in exactly. All weights are (out, in), as the adapters' LinearViews show them.

Before α reaches 1 the merge changes the output by exactly ``(1 − α)·W2·(f(z) − z)`` with ``z = W1·x + b1``, since
``f_α(z) − z = (1 − α)(f(z) − z)``. `collapse_error_bound` bounds its norm by ``(1 − α)·‖W2‖₂·‖f(z) − z‖`` on
calibration inputs; `collapse_error` measures it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BatchNormStats:
    """What an eval-mode BatchNorm computes: ``y = γ·(x − μ)/√(σ² + eps) + β`` per feature.

    Attributes:
        running_mean, running_var: μ and σ², shape (features,).
        weight, bias: γ and β, or None when the norm is not affine.
        eps: The norm's epsilon.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 1e-5

    @classmethod
    def from_module(cls, norm: nn.modules.batchnorm._BatchNorm) -> BatchNormStats:
        """Reads a BatchNorm module; only eval mode with running statistics is a fixed affine map.

        Raises:
            TypeError: `norm` is not a BatchNorm module.
            ValueError: the norm is in training mode or keeps no running statistics (it would normalise with the
                statistics of each batch, which no single linear map reproduces).
        """
        if not isinstance(norm, nn.modules.batchnorm._BatchNorm):
            raise TypeError(f"expected a torch BatchNorm module, got {type(norm).__name__}.")
        if norm.training or norm.running_mean is None or norm.running_var is None:
            raise ValueError(
                f"cannot fold {type(norm).__name__} with training={norm.training} and "
                f"track_running_stats={norm.track_running_stats}: only an eval-mode norm with running statistics is "
                "a fixed affine map. Call .eval() on the model (and keep running statistics) before collapsing."
            )
        weight = None if norm.weight is None else norm.weight.detach()
        bias = None if norm.bias is None else norm.bias.detach()
        return cls(norm.running_mean.detach(), norm.running_var.detach(), weight, bias, float(norm.eps))

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, t) in float64 with ``norm(x) = s·x + t``."""
        scale = torch.rsqrt(self.running_var.double() + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.double()
        shift = -self.running_mean.double() * scale
        if self.bias is not None:
            shift = shift + self.bias.double()
        return scale, shift


def fold_batchnorm_into_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, norm: BatchNormStats
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (W', b') with ``W'·x + b' == norm(W·x + b)`` for a linear map followed by an eval-mode BatchNorm.

    Args:
        weight: (out, in) weight of the linear map.
        bias: (out,) bias or None.
        norm: The statistics of the BatchNorm over the `out` features.

    Returns:
        The folded weight and bias (always a bias: the norm shifts), in the dtype of `weight`, computed in float64.
    """
    _check_features(norm, weight.shape[0], "the linear map's outputs")
    scale, shift = norm.scale_shift()
    new_weight = weight.double() * scale[:, None]
    new_bias = shift if bias is None else bias.double() * scale + shift
    return new_weight.to(weight.dtype), new_bias.to(weight.dtype)


def collapse_linear_pair(
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    between: BatchNormStats | None = None,
    after: BatchNormStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The single linear map equal to ``after(W2·between(W1·x + b1) + b2)`` (the norms are optional).

    Only exact when the activation between the two maps is the identity (α = 1); `collapse_error` says how far off
    it is otherwise. Computed in float64 and cast to the dtype of `w1`, so the merge adds one rounding only.

    Args:
        w1, b1: The first map, (hidden, in) and (hidden,) or None.
        w2, b2: The second map, (out, hidden) and (out,) or None.
        between: An eval-mode BatchNorm over the hidden features (before or after the linearised activation: with
            the identity there, both are the same map).
        after: An eval-mode BatchNorm over the output features.

    Returns:
        (W, b): W is (out, in); b is None only when neither map nor any norm adds a bias.

    Raises:
        ValueError: the shapes do not chain.
    """
    if w1.ndim != 2 or w2.ndim != 2 or w2.shape[1] != w1.shape[0]:
        raise ValueError(
            f"cannot chain weights of shapes {tuple(w1.shape)} then {tuple(w2.shape)}: expected (hidden, in) then "
            "(out, hidden), both (out, in) as LinearView shows them. Transpose Conv1D storage through the view."
        )
    dtype = w1.dtype
    first_w, first_b = w1.double(), None if b1 is None else b1.double()
    if between is not None:
        first_w, first_b = fold_batchnorm_into_linear(first_w, first_b, between)
    w2_64 = w2.double()
    weight = w2_64 @ first_w
    bias = None if first_b is None else w2_64 @ first_b
    if b2 is not None:
        bias = b2.double() if bias is None else bias + b2.double()
    if after is not None:
        weight, bias = fold_batchnorm_into_linear(weight, bias, after)
    return weight.to(dtype), None if bias is None else bias.to(dtype)


@torch.no_grad()
def collapse_error_bound(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    alpha: float | torch.Tensor,
) -> torch.Tensor:
    """Upper bound on ‖MLP_α(X) − collapsed(X)‖_F over calibration inputs X: ``(1 − α)·‖W2‖₂·‖f(Z) − Z‖_F``.

    Derivation (written here; see docs/methods/layer_collapse.md): with ``Z = X·W1ᵀ + b1`` the two outputs differ by
    ``(f_α(Z) − Z)·W2ᵀ = (1 − α)·(f(Z) − Z)·W2ᵀ``, and ``‖M·W2ᵀ‖_F ≤ ‖W2‖₂·‖M‖_F``. For ReLU ``f(Z) − Z = −min(0, Z)``:
    the bound is (1 − α) times the spectral norm of W2 times the mass of the negative pre-activations, and it is
    zero at α = 1. Divide by the norm of the MLP output for a relative figure.

    Provenance: the paper states a bound of this kind as its eq. (4), but only its abstract could be read while this
    was written, so this is our own derivation, not a transcription; its norms or constants may differ from the
    paper's. `collapse_error` measures the actual difference, which this bound dominates.

    Args:
        x: Calibration inputs of the MLP, (..., in).
        w1, b1: The first map, (hidden, in) and (hidden,) or None.
        w2: The second map's weight, (out, hidden); its bias cancels in the difference.
        activation: The original activation f (α = 0), e.g. ``module.base`` of a ParametricActivation.
        alpha: The current α in [0, 1].

    Returns:
        A float64 scalar.
    """
    one_minus_alpha = 1.0 - torch.as_tensor(alpha, dtype=torch.float64).detach().cpu()
    if one_minus_alpha == 0:
        return torch.zeros((), dtype=torch.float64)
    z = _pre_activation(x, w1, b1)
    gap = torch.linalg.vector_norm(activation(z) - z)
    spectral = torch.linalg.matrix_norm(w2.detach().double(), ord=2)
    return one_minus_alpha * spectral.cpu() * gap.cpu()


@torch.no_grad()
def collapse_error(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    alpha: float | torch.Tensor,
    relative: bool = True,
) -> torch.Tensor:
    """Measured ‖MLP_α(X) − collapsed(X)‖_F on calibration inputs, divided by ‖MLP_α(X)‖_F when `relative`.

    The MLP uses ``f_α = f + α·(x − f)`` like `ParametricActivation`; the collapsed map is the one
    `collapse_linear_pair` builds, so the figure includes the (float64) rounding of the merge itself.

    Args:
        x: Calibration inputs, (..., in).
        w1, b1, w2, b2: The two maps, (out, in) layout.
        activation: The original activation f (α = 0).
        alpha: The current α in [0, 1].
        relative: Divide by the norm of the MLP's output.

    Returns:
        A float64 scalar (0 when the output and the difference are both zero).
    """
    z = _pre_activation(x, w1, b1)
    weight_alpha = torch.as_tensor(alpha, dtype=torch.float64, device=z.device)
    hidden = torch.lerp(activation(z), z, weight_alpha)
    w2_64 = w2.double()
    mlp = hidden @ w2_64.T
    if b2 is not None:
        mlp = mlp + b2.double()
    weight, bias = collapse_linear_pair(w1.double(), _double(b1), w2_64, _double(b2))
    collapsed = x.reshape(-1, x.shape[-1]).double() @ weight.T
    if bias is not None:
        collapsed = collapsed + bias
    difference = torch.linalg.vector_norm(mlp - collapsed)
    if not relative:
        return difference.cpu()
    scale = torch.linalg.vector_norm(mlp)
    return (difference / scale if scale > 0 else difference).cpu()


def _pre_activation(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None) -> torch.Tensor:
    """Z = X·W1ᵀ + b1 in float64, rows flattened to (N, hidden)."""
    if x.shape[-1] != w1.shape[1]:
        raise ValueError(f"inputs have {x.shape[-1]} features but the first map expects {w1.shape[1]}.")
    z = x.detach().reshape(-1, x.shape[-1]).double() @ w1.detach().double().T
    return z if b1 is None else z + b1.detach().double()


def _double(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().double()


def _check_features(norm: BatchNormStats, features: int, what: str) -> None:
    if norm.running_mean.shape != (features,):
        raise ValueError(
            f"the BatchNorm has {tuple(norm.running_mean.shape)} features but {what} has {features}; fold a norm "
            "only into the map whose outputs it normalises."
        )
