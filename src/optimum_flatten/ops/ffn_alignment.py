"""Aligning and averaging feed-forward sublayers (Verma et al., "Merging Feed-Forward Sublayers for Compressed
Transformers"), as pure tensor functions.

Two feed-forward sublayers compute the same kind of function up to an ordering of their hidden units: permuting
the units of one (rows of the first linear maps and their biases, columns of the second) leaves its function
exactly unchanged. Before averaging the parameters of several sublayers, each one is permuted so that its units
line up with those of an anchor sublayer: unit j of a layer is matched to the anchor unit i whose activations, on
calibration tokens, correlate most with its own (a linear assignment maximising the summed correlation).

Everything here sees weights as (out, in) matrices, the convention of the adapters' `LinearView`, and never
mutates its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

AlignmentSignal = Literal["pre_activation", "hidden"]


# ----------------------------------------------------------------------------------------------- correlation
@dataclass(frozen=True)
class CorrelationSums:
    """Sufficient statistics of the correlation between two sets of features, on `count` tokens (float64).

    Stored centred (Chan et al.'s parallel form) rather than as raw sums of products: a raw Σx² − n·m² loses every
    digit of a feature with a large mean and a small spread, and a dead (constant) unit must come out with a
    variance of exactly zero, not a rounding residue that would be divided by.

    Attributes:
        count: Number of tokens.
        mean_x, mean_y: (dx,), (dy,) feature means.
        m2_x, m2_y: (dx,), (dy,) centred sums of squares Σ (x − mean_x)².
        cross: (dx, dy) centred sum of products Σ (x − mean_x)(y − mean_y)ᵀ.
    """

    count: int
    mean_x: torch.Tensor
    mean_y: torch.Tensor
    m2_x: torch.Tensor
    m2_y: torch.Tensor
    cross: torch.Tensor

    def __add__(self, other: CorrelationSums) -> CorrelationSums:
        """The statistics of the union of both token sets (exact combination of centred sums)."""
        if self.count == 0:
            return other
        if other.count == 0:
            return self
        n = self.count + other.count
        weight = self.count * other.count / n
        delta_x = other.mean_x - self.mean_x
        delta_y = other.mean_y - self.mean_y
        return CorrelationSums(
            count=n,
            mean_x=self.mean_x + delta_x * (other.count / n),
            mean_y=self.mean_y + delta_y * (other.count / n),
            m2_x=self.m2_x + other.m2_x + delta_x.square() * weight,
            m2_y=self.m2_y + other.m2_y + delta_y.square() * weight,
            cross=self.cross + other.cross + torch.outer(delta_x, delta_y) * weight,
        )


def correlation_sums(x: torch.Tensor, y: torch.Tensor) -> CorrelationSums:
    """The correlation statistics of one batch of tokens; add the results of several batches with ``+``.

    The expensive product (tokens × dx × dy) runs in float32 on features centred by their float32-rounded mean;
    the error of that rounding is removed exactly in float64 (Σ(x − m̃)(y − ñ)ᵀ = Σ(x − m)(y − n)ᵀ + N (m − m̃)(n − ñ)ᵀ),
    the same trade as `calibration.stats.SecondMoment`. float64 inputs take a float64 path throughout.

    Args:
        x: (tokens, dx) features of the first layer (padding already removed).
        y: (tokens, dy) features of the second layer, on the same tokens.

    Returns:
        The centred sums, float64, on the inputs' device.
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"correlation_sums needs two (tokens, features) matrices on the same tokens, got {tuple(x.shape)} and "
            f"{tuple(y.shape)}."
        )
    n = x.shape[0]
    if n == 0:
        dx, dy = x.shape[1], y.shape[1]
        zeros = {"dtype": torch.float64, "device": x.device}
        return CorrelationSums(
            0,
            torch.zeros(dx, **zeros),
            torch.zeros(dy, **zeros),
            torch.zeros(dx, **zeros),
            torch.zeros(dy, **zeros),
            torch.zeros(dx, dy, **zeros),
        )
    work = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
    mean_x = x.sum(dim=0, dtype=torch.float64) / n
    mean_y = y.sum(dim=0, dtype=torch.float64) / n
    centred_x = x.to(work) - mean_x.to(work)
    centred_y = y.to(work) - mean_y.to(work)
    # How far the rounded centres are from the exact means; exactly zero for a constant feature.
    shift_x = centred_x.sum(dim=0, dtype=torch.float64) / n
    shift_y = centred_y.sum(dim=0, dtype=torch.float64) / n
    cross = (centred_x.T @ centred_y).double() - n * torch.outer(shift_x, shift_y)
    m2_x = centred_x.square().sum(dim=0, dtype=torch.float64) - n * shift_x.square()
    m2_y = centred_y.square().sum(dim=0, dtype=torch.float64) - n * shift_y.square()
    return CorrelationSums(n, mean_x, mean_y, m2_x.clamp_min(0.0), m2_y.clamp_min(0.0), cross)


#: A feature whose standard deviation is at most this fraction of its mean's magnitude counts as constant (dead).
DEAD_RELATIVE_STD = 1e-6


def _alive(root_m2: torch.Tensor, mean: torch.Tensor, count: int) -> torch.Tensor:
    std = root_m2 / count**0.5
    return (std > 0) & (std > DEAD_RELATIVE_STD * mean.abs())


def correlation_from_sums(sums: CorrelationSums) -> torch.Tensor:
    """(dx, dy) Pearson correlations corr[i, j] between feature i of x and feature j of y, float64.

    A feature with zero variance (a dead unit) has no defined correlation; it gets 0 with everything (never NaN),
    so the assignment pairs dead units with whatever is left over instead of failing. "Zero" means a standard
    deviation at most `DEAD_RELATIVE_STD` times the feature's mean magnitude: a constant that is not exactly
    representable (3.7) leaves a rounding residue in its computed mean, and the correlation of that residue would
    be noise. Values are clipped to [-1, 1] against rounding.

    Raises:
        ValueError: when no token was accumulated.
    """
    if sums.count == 0:
        raise ValueError("no calibration token reached this correlation (are all tokens masked?).")
    std_x = sums.m2_x.clamp_min(0.0).sqrt()
    std_y = sums.m2_y.clamp_min(0.0).sqrt()
    scale = torch.outer(std_x, std_y)
    alive = torch.outer(_alive(std_x, sums.mean_x, sums.count), _alive(std_y, sums.mean_y, sums.count))
    corr = torch.where(alive, sums.cross / torch.where(alive, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    return corr.clamp(-1.0, 1.0)


def feature_correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(dx, dy) correlations of two (tokens, features) matrices in one go (one batch of `correlation_sums`)."""
    return correlation_from_sums(correlation_sums(x, y))


# ------------------------------------------------------------------------------------------------ assignment
def alignment_permutation(correlation: torch.Tensor) -> torch.Tensor:
    """The permutation of a layer's hidden units that best lines them up with the anchor's.

    Solves max_π Σ_i corr[i, π(i)] exactly (Hungarian / Jonker-Volgenant, `scipy.optimize.linear_sum_assignment`).

    Args:
        correlation: (d, d) corr[i, j] between anchor unit i and unit j of the layer to align.

    Returns:
        (d,) long tensor `perm`: unit ``perm[i]`` of the layer is matched to anchor unit ``i``, so
        `permute_mlp_units(weights, perm)` puts it at position ``i``.
    """
    from scipy.optimize import linear_sum_assignment

    if correlation.dim() != 2 or correlation.shape[0] != correlation.shape[1]:
        raise ValueError(
            f"alignment needs a square (units, units) correlation matrix, got {tuple(correlation.shape)}; both "
            "layers must have the same number of hidden units."
        )
    if not torch.isfinite(correlation).all():
        raise ValueError("the correlation matrix holds NaN or inf; compute it with correlation_from_sums.")
    rows, cols = linear_sum_assignment(correlation.detach().double().cpu().numpy(), maximize=True)
    perm = torch.empty(correlation.shape[0], dtype=torch.long)
    perm[torch.as_tensor(rows, dtype=torch.long)] = torch.as_tensor(cols, dtype=torch.long)
    return perm


# ------------------------------------------------------------------------------------------------ MLP weights
@dataclass(frozen=True)
class MlpWeights:
    """The parameters of one feed-forward sublayer, every weight (out, in).

    Gated (SwiGLU): down(act(gate x) ⊙ up x); non-gated: down(act(up x)). `gate_weight` is None for a non-gated
    MLP; biases are None when the linear map has none.
    """

    up_weight: torch.Tensor
    up_bias: torch.Tensor | None
    gate_weight: torch.Tensor | None
    gate_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None

    @property
    def num_units(self) -> int:
        return self.up_weight.shape[0]

    def layout(self) -> dict[str, tuple[int, ...] | None]:
        """Shape of every tensor (None when absent): MLPs can be averaged or tied only if their layouts agree."""
        return {
            name: None if tensor is None else tuple(tensor.shape)
            for name, tensor in (
                ("up_weight", self.up_weight),
                ("up_bias", self.up_bias),
                ("gate_weight", self.gate_weight),
                ("gate_bias", self.gate_bias),
                ("down_weight", self.down_weight),
                ("down_bias", self.down_bias),
            )
        }


def _rows(tensor: torch.Tensor | None, perm: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[perm.to(tensor.device)]


def permute_mlp_units(weights: MlpWeights, perm: torch.Tensor) -> MlpWeights:
    """The same MLP with its hidden units reordered so that new unit i is old unit ``perm[i]`` (exact).

    Rows of up/gate and their biases and columns of down move together; the down bias is per output, not per
    unit, and stays. The function computed is unchanged bit for bit up to summation order in down.
    """
    if perm.dim() != 1 or perm.numel() != weights.num_units:
        raise ValueError(f"perm must be a ({weights.num_units},) index vector, got shape {tuple(perm.shape)}.")
    if not torch.equal(perm.sort().values.cpu(), torch.arange(weights.num_units)):
        raise ValueError("perm must be a permutation of 0..num_units-1 (every unit exactly once).")
    return MlpWeights(
        up_weight=_rows(weights.up_weight, perm),
        up_bias=_rows(weights.up_bias, perm),
        gate_weight=_rows(weights.gate_weight, perm),
        gate_bias=_rows(weights.gate_bias, perm),
        down_weight=weights.down_weight[:, perm.to(weights.down_weight.device)],
        down_bias=None if weights.down_bias is None else weights.down_bias.clone(),
    )


def _mean(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if tensors[0] is None:
        return None
    dtype = tensors[0].dtype
    # Averaged in at least float32: half-precision sums of k terms would round each partial sum.
    work = torch.promote_types(dtype, torch.float32)
    return torch.stack([t.to(work) for t in tensors]).mean(dim=0).to(dtype)


def average_mlps(members: Sequence[MlpWeights]) -> MlpWeights:
    """The element-wise mean of k MLPs of one layout (align them first for the "permute" variant).

    Raises:
        ValueError: when there is no member or the layouts differ (shapes, gate or biases present in some only).
    """
    if not members:
        raise ValueError("average_mlps needs at least one MLP.")
    layouts = [m.layout() for m in members]
    if any(layout != layouts[0] for layout in layouts[1:]):
        raise ValueError(f"cannot average MLPs of different layouts, got {layouts}; only same-shaped MLPs merge.")
    return MlpWeights(
        up_weight=_mean([m.up_weight for m in members]),
        up_bias=_mean([m.up_bias for m in members]),
        gate_weight=_mean([m.gate_weight for m in members]),
        gate_bias=_mean([m.gate_bias for m in members]),
        down_weight=_mean([m.down_weight for m in members]),
        down_bias=_mean([m.down_bias for m in members]),
    )


# ------------------------------------------------------------------------------------------------ activations
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias)


def num_alignment_signals(weights: MlpWeights, signal: AlignmentSignal = "pre_activation") -> int:
    """How many matrices `alignment_signals` returns for this MLP (2: gate and up pre-activations; else 1)."""
    return 2 if signal == "pre_activation" and weights.gate_weight is not None else 1


def alignment_signals(
    x: torch.Tensor,
    weights: MlpWeights,
    signal: AlignmentSignal = "pre_activation",
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The per-unit activations whose correlations decide the alignment, one (tokens, units) matrix per signal.

    ``"pre_activation"`` is the paper's choice (the output of the first linear map, before the non-linearity). A
    gated MLP has two first linear maps per unit, and a unit is only the same unit if both agree, so it gives both
    the gate and the up pre-activation; the caller averages their correlations (see docs/methods/ffn_merge.md).
    ``"hidden"`` is the input of the down projection, act(gate x) ⊙ up x or act(up x).

    Args:
        x: (tokens, hidden) inputs of the MLP (after its norm).
        weights: The MLP's parameters.
        signal: Which activation to correlate.
        activation: The MLP's non-linearity; needed for ``"hidden"``.
    """
    up = _linear(x, weights.up_weight, weights.up_bias)
    gate = None if weights.gate_weight is None else _linear(x, weights.gate_weight, weights.gate_bias)
    if signal == "pre_activation":
        return [up] if gate is None else [gate, up]
    if signal == "hidden":
        if activation is None:
            raise ValueError("the 'hidden' alignment signal needs the MLP's activation function.")
        return [activation(up)] if gate is None else [activation(gate) * up]
    raise ValueError(f"alignment signal must be 'pre_activation' or 'hidden', got {signal!r}.")


__all__ = [
    "DEAD_RELATIVE_STD",
    "AlignmentSignal",
    "CorrelationSums",
    "MlpWeights",
    "alignment_permutation",
    "alignment_signals",
    "average_mlps",
    "correlation_from_sums",
    "correlation_sums",
    "feature_correlation",
    "num_alignment_signals",
    "permute_mlp_units",
]
