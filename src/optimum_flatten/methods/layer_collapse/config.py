"""LayerCollapse's options: which MLPs to linearise, when α counts as linear, and the method's name.

Kept apart from the steps so that `prepare`, `collapse` and `export` read one definition of the selection (the last
MLPs not collapsed yet) and of the method name the report and the saved checkpoint carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config import FlattenConfig
from ...options.methods.layer_collapse import LayerCollapseConfig

#: The name LayerCollapse is registered, configured and reported under (``FlattenConfig(method=...)``, the report
#: key of its per-MLP record, the ``method`` of a checkpoint saved by `save_layer_collapse`).
METHOD_NAME = "layer_collapse"


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
