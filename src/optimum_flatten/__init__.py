"""optimum-flatten: make transformer models shallower without losing what they know.

Public API: `FlattenConfig` (what), `FlattenQuantizer` (the compressor), `get_adapter` / `register_adapter`
(where), `register_method` (how). Importing this package imports neither `datasets` nor `peft`.

The public names load on first use (PEP 562), and with them the built-in adapters and the ``"flatten"``
quantization method registered with transformers (so ``from optimum_flatten import FlattenConfig`` is all that
compress-on-load needs). The package itself imports nothing heavy: the command line, whose modules sit inside it,
parses and refuses its arguments before torch and transformers are imported (docs/cli.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "CalibrationConfig",
    "FlattenConfig",
    "FlattenQuantizer",
    "LayerPlan",
    "get_adapter",
    "register_adapter",
    "register_method",
]

if TYPE_CHECKING:
    from .adapters.registry import get_adapter, register_adapter
    from .config import CalibrationConfig, FlattenConfig
    from .plan import LayerPlan
    from .quantizer import FlattenQuantizer
    from .registry import register_method


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'optimum_flatten' has no attribute {name!r}")
    from . import adapters as _adapters  # noqa: F401  (registers the built-in adapters)
    from .adapters.registry import get_adapter, register_adapter
    from .config import CalibrationConfig, FlattenConfig
    from .integration import register as _register_with_transformers
    from .plan import LayerPlan
    from .quantizer import FlattenQuantizer
    from .registry import register_method

    _register_with_transformers()
    names = {
        "CalibrationConfig": CalibrationConfig,
        "FlattenConfig": FlattenConfig,
        "FlattenQuantizer": FlattenQuantizer,
        "LayerPlan": LayerPlan,
        "get_adapter": get_adapter,
        "register_adapter": register_adapter,
        "register_method": register_method,
    }
    globals().update(names)  # later lookups are plain attributes
    return names[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
