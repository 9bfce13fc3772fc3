"""How: one module per compression method, or one package for a method of several parts (FlattenGPT, ffn_merge,
LaCo and the merge search Sliding-Window Merging reuses, LayerCollapse), each registered by name."""

from __future__ import annotations

from ..registry import get_method_class, register_method, registered_methods

__all__ = ["CompressionMethod", "MethodContext", "get_method_class", "register_method", "registered_methods"]


def __getattr__(name: str) -> object:
    """`CompressionMethod` and `MethodContext` load on first use: the registry alone (names and options) must not
    import torch, so that the command line can list the methods and their flags before any heavy import."""
    if name in ("CompressionMethod", "MethodContext"):
        from ..compression import method

        return getattr(method, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
