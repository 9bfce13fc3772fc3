"""LayerCollapse's options: which MLPs to linearise, when α counts as linear, and the method's name.

Kept apart from the steps so that `prepare`, `collapse` and `export` read one definition of the selection (the last
MLPs not collapsed yet) and of the method name the report and the saved checkpoint carry.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ...config import FlattenConfig, MethodConfig

#: The name LayerCollapse is registered, configured and reported under (``FlattenConfig(method=...)``, the report
#: key of its per-MLP record, the ``method`` of a checkpoint saved by `save_layer_collapse`).
METHOD_NAME = "layer_collapse"


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


def resolve_config(
    config: LayerCollapseConfig | FlattenConfig | None, options: Mapping[str, Any]
) -> LayerCollapseConfig:
    """The `LayerCollapseConfig` a step runs with: `config` (or the method config of a LayerCollapse
    `FlattenConfig`) with `options` over it, so that the steps take the config the user compresses with.

    Raises:
        ValueError: a FlattenConfig of another method.
        TypeError: any other config type.
    """
    if isinstance(config, FlattenConfig):
        if config.method != METHOD_NAME:
            raise ValueError(f"expected a FlattenConfig with method={METHOD_NAME!r}, got method={config.method!r}.")
        config = config.method_config
    if config is None:
        return LayerCollapseConfig.from_dict(dict(options))
    if not isinstance(config, LayerCollapseConfig):
        raise TypeError(f"config must be a LayerCollapseConfig or a FlattenConfig, got {type(config).__name__}.")
    if options:
        return LayerCollapseConfig.from_dict({**config.to_dict(), **options})
    return config


__all__ = ["METHOD_NAME", "LayerCollapseConfig", "resolve_config"]
