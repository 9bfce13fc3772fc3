"""LayerCollapse's options: a torch-free declaration, read by `FlattenConfig`, the command line and the
method (methods/layer_collapse/).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..hints import MethodConfig


@dataclass
class LayerCollapseConfig(MethodConfig):
    """Options of LayerCollapse.

    Attributes:
        num_mlps: How many MLP blocks to linearise, counted from the last block downwards and skipping MLPs that
            are already collapsed (the paper collapses the last layers first, one at a time: they are the closest to
            linear).
        mlp_fraction: The same as a fraction of the stack's blocks, rounded to the nearest whole block (at least 1).
            Give at most one of `num_mlps` and `mlp_fraction`. `prepare_layer_collapse_` needs one; the collapse
            step (the quantizer) collapses every prepared MLP and, when one is given, checks that the prepared
            MLPs are exactly the ones it selects.
        threshold: An MLP collapses only when ``|1 − α| < threshold``.
        initial_alpha: α set by `prepare_layer_collapse_`; 0 keeps every output unchanged.
        measure_error: Measure the error bound and the actual error of each collapse on the calibration
            activations (needs calibration data in the quantizer); False collapses without data.
    """

    num_mlps: int | None = None
    mlp_fraction: float | None = None
    threshold: float = 1e-4
    initial_alpha: float = 0.0
    measure_error: bool = True

    def __post_init__(self) -> None:
        if self.num_mlps is not None and (
            not isinstance(self.num_mlps, int) or isinstance(self.num_mlps, bool) or self.num_mlps < 1
        ):
            raise ValueError(f"num_mlps must be a positive integer or None, got {self.num_mlps!r}.")
        if self.mlp_fraction is not None and (
            isinstance(self.mlp_fraction, bool)
            or not isinstance(self.mlp_fraction, (int, float))
            or not 0.0 < float(self.mlp_fraction) <= 1.0
        ):
            raise ValueError(f"mlp_fraction must be a fraction in (0, 1] or None, got {self.mlp_fraction!r}.")
        if self.num_mlps is not None and self.mlp_fraction is not None:
            raise ValueError(
                f"give at most one of num_mlps and mlp_fraction, got num_mlps={self.num_mlps!r} and "
                f"mlp_fraction={self.mlp_fraction!r}; e.g. num_mlps=2 or mlp_fraction=0.25."
            )
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(
                f"threshold must be a positive number (collapse when |1 - alpha| < it), got {self.threshold!r}."
            )
        if isinstance(self.initial_alpha, bool) or not isinstance(self.initial_alpha, (int, float)):
            raise ValueError(f"initial_alpha must be a number in [0, 1], got {self.initial_alpha!r}.")
        if not 0.0 <= float(self.initial_alpha) <= 1.0:
            raise ValueError(
                f"initial_alpha must lie in [0, 1] (0 = the pretrained activation), got {self.initial_alpha}."
            )
        if not isinstance(self.measure_error, bool):
            raise TypeError(f"measure_error must be True or False, got {self.measure_error!r}.")

    @property
    def selects(self) -> bool:
        """Whether the config names a number of MLPs (else the collapse step takes every prepared one)."""
        return self.num_mlps is not None or self.mlp_fraction is not None

    def selected_indices(self, num_layers: int, collapsed: Collection[int] = ()) -> list[int]:
        """The last `num_mlps` (or ``round(mlp_fraction · num_layers)``) blocks of a stack whose MLP is not
        `collapsed` yet, ascending.

        Skipping the collapsed MLPs makes repeated rounds walk down the stack, one MLP (or one batch) at a time, as
        the paper does: after collapsing the last MLP, ``num_mlps=1`` selects the one below it.

        Raises:
            ValueError: neither option is set, or more MLPs are asked for than the stack has left un-collapsed.
        """
        if not self.selects:
            raise ValueError(
                "say how many MLPs to linearise: num_mlps=k (the last k blocks) or mlp_fraction=f (the last "
                f"round(f x {num_layers}) blocks), got neither."
            )
        if self.num_mlps is not None:
            count, source = self.num_mlps, f"num_mlps={self.num_mlps}"
        else:
            count = max(1, math.floor(float(self.mlp_fraction) * num_layers + 0.5))
            source = f"mlp_fraction={self.mlp_fraction} of {num_layers} blocks"
        candidates = [i for i in range(num_layers) if i not in set(collapsed)]
        if count > len(candidates):
            already = f", {num_layers - len(candidates)} of them already collapsed" if collapsed else ""
            raise ValueError(
                f"cannot linearise {count} MLPs ({source}): the stack has {num_layers} blocks{already}; choose at "
                f"most {len(candidates)}."
            )
        return candidates[len(candidates) - count :]


@dataclass
class LinearisationSchedule:
    """Two AdamLC phases that take every prepared α to 1 while the task loss trains every weight.

    - Pull: `pull_steps` steps at `learning_rate` with ``2·lr·lc = pull_per_step``, so each step moves α that
      fraction of its remaining distance to 1 (5% by default: 0.95¹⁵⁰ leaves 5e-4) while the weights adapt to the
      ever more linear activation.
    - Land: `snap_steps` steps with ``2·lr·lc = 1`` (α lands on 1 every step) at `snap_learning_rate`, chosen below
      the collapse threshold so that Adam's own step on α cannot move it 1e-4 away before the collapse.

    The defaults are what the BERT rows of benchmarks/families and examples/layer_collapse use.
    """

    pull_steps: int = 150
    learning_rate: float = 1e-4
    pull_per_step: float = 0.05
    snap_steps: int = 10
    snap_learning_rate: float = 5e-5
    batch_size: int = 16
    seed: int = 0
    logging_steps: int | None = None
    extra_training_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pull_steps < 0 or self.snap_steps < 1 or self.batch_size < 1:
            raise ValueError(
                f"need pull_steps >= 0, snap_steps >= 1 and batch_size >= 1, got {self.pull_steps}, "
                f"{self.snap_steps} and {self.batch_size}."
            )
        if not 0 < self.pull_per_step <= 1:
            raise ValueError(f"pull_per_step is a fraction of the distance to 1 in (0, 1], got {self.pull_per_step}.")
        for name in ("learning_rate", "snap_learning_rate"):
            value = getattr(self, name)
            # The pull strength is pull_per_step / (2·lr): a rate of 0 divides by zero, and a negative or NaN one
            # was refused only as a negative lc, a quantity the user never set, after the model had loaded.
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
        if not 0 <= self.seed < 2**32:  # numpy's seed range, which the Trainer would refuse only once training
            raise ValueError(f"seed must be in 0..2**32 - 1, got {self.seed}.")
        if self.logging_steps is not None and self.logging_steps < 1:
            raise ValueError(
                f"logging_steps must be at least 1 (or None: a quarter of each phase), got {self.logging_steps}."
            )
