"""optimum-flatten: make transformer models shallower without losing what they know.

Public API: `FlattenConfig` (what), `FlattenQuantizer` (the compressor), `get_adapter` / `register_adapter`
(where), `register_method` (how). Importing this package imports neither `datasets` nor `peft`.
"""

from . import adapters as _adapters  # noqa: F401  (registers the built-in adapters)
from .adapters.registry import get_adapter, register_adapter
from .config import CalibrationConfig, FlattenConfig
from .integration import register as _register_with_transformers
from .methods.registry import register_method
from .plan import LayerPlan
from .quantizer import FlattenQuantizer

_register_with_transformers()

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
