"""Names of the corrections folded on top of a method that removes layers (torch-free declarations).

The estimators are the ways a linear bridge can be fitted (`ops.linear_map`); the compensations are Prune&Comp's
rescalings (`corrections/compensation.py`). Declared here, below the code that implements them, so that the options
(and the command line's choices) are known without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..utils.errors import did_you_mean

#: Names of the ways a map can be estimated (see `solve_least_squares`, `solve_least_squares_with_gain` and
#: `fit_cosine` in `ops.linear_map`). ``"lstsq_gain"`` is least squares with one scalar gain on the residual
#: stream, fitted jointly; ``"lstsq_down"`` refits the whole down projection by least squares on its own inputs;
#: ``"diagonal"`` restricts T to a per-channel gain (`solve_diagonal`), what a norm after the MLP can hold.
ESTIMATORS = ("lstsq", "lstsq_gain", "lstsq_down", "cosine", "diagonal")

#: Names of the corrections folded after a layer drop (see corrections/compensation.py).
COMPENSATIONS = ("scale",)


@dataclass
class BridgeOptions:
    """How the map is estimated.

    Attributes:
        estimator: ``"lstsq"`` (closed form on float64 statistics), ``"lstsq_gain"`` (the same with one scalar
            gain α on the residual stream at the cut, fitted jointly with T in closed form, ``α Y + M T ≈ L``, and
            folded into every writer of the stream upstream as Prune&Comp folds its compensation; not in either
            paper: T alone carries the stream through the removed layers unscaled, the gain lets the whole stream
            shrink or grow by what those layers did to its magnitude; see docs/methods/replaceme.md),
            ``"lstsq_down"`` (the bridged layer's down projection refitted by least squares on its own inputs, the
            MLP's intermediate activations: T's fit is a special case of it; not in the paper), ``"cosine"``
            (Adam on the cosine distance) or ``"diagonal"`` (T restricted to a gain per channel, least squares
            channel by channel; not in the paper: the one map that folds exactly into the gain of a norm applied
            after the MLP, as Gemma, OLMo-2 and GLM-4 have, and available on every family that takes ``"lstsq"``).
        cosine_epochs, cosine_lr, cosine_minibatch: The cosine fit's bounded optimisation (see `fit_cosine`).
        correct_after: Also refit the down projections of this many kept layers after every bridged span, each
            towards the dense state after its own layer, so that they absorb what the bridge left (not in the paper;
            0: the bridges alone).
        down_ridge: With ``"lstsq_down"``, the ridge towards ReplaceMe's folded map, relative to the mean diagonal of
            AᵀA (0: the plain refit; ``inf``: ReplaceMe). None: chosen per bridge from `RIDGE_GRID` on the last
            calibration batch (see `corrections.linear_bridge._refit_down_from_`).
    """

    estimator: str = "lstsq"
    cosine_epochs: int = 10
    cosine_lr: float = 1e-4
    cosine_minibatch: int = 1024
    correct_after: int = 0
    down_ridge: float | None = None

    @property
    def stream_gain(self) -> bool:
        """Whether each bridge also fits (and folds upstream) a scalar gain on the stream."""
        return self.estimator == "lstsq_gain"

    def __post_init__(self) -> None:
        check_estimator(self.estimator)
        if not isinstance(self.correct_after, int) or isinstance(self.correct_after, bool) or self.correct_after < 0:
            raise ValueError(f"correct_after must be a non-negative integer, got {self.correct_after!r}.")
        for name in ("cosine_epochs", "cosine_minibatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not self.cosine_lr > 0:
            raise ValueError(f"cosine_lr must be positive, got {self.cosine_lr!r}.")
        if self.down_ridge is not None and not self.down_ridge >= 0:
            raise ValueError(f"down_ridge must be None (chosen on held-out tokens) or >= 0, got {self.down_ridge!r}.")


def check_estimator(name: Any) -> None:
    if name not in ESTIMATORS:
        raise ValueError(
            f"unknown linear-replacement estimator {name!r}.{did_you_mean(str(name), ESTIMATORS)} "
            f"Choose one of {list(ESTIMATORS)}."
        )


@dataclass(frozen=True)
class Corrections:
    """What is folded at each cut after the plan is applied (at most one of the two)."""

    linear_replacement: str | None = None
    compensation: str | None = None
    seed: int = 0

    def describe(self) -> str:
        if self.linear_replacement:
            return f"linear_replacement={self.linear_replacement}"
        if self.compensation:
            return f"compensation={self.compensation}"
        return "none"
