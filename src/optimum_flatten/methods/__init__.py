"""How: one module per compression method (a package for a method of several steps: LayerCollapse), each
registered by name."""

from __future__ import annotations


def _load_builtin_methods() -> None:
    """Imports the built-in method modules once (explicit list, no package scanning)."""
    from . import (  # noqa: F401
        auto,
        come,
        ffn_merge,
        flattengpt,
        greedy_replace,
        laco,
        layer_collapse,
        replaceme,
        shortgpt,
        sleb,
        sliding_window,
        uidl,
    )


from .base import CompressionMethod, MethodContext  # noqa: E402
from .registry import get_method_class, register_method, registered_methods  # noqa: E402

__all__ = ["CompressionMethod", "MethodContext", "get_method_class", "register_method", "registered_methods"]
