"""Adapter registry: one adapter class per architecture family, chosen by ``config.model_type``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..utils.errors import UnsupportedArchitectureError

_ADAPTERS: dict[str, type] = {}


def register_adapter(cls: type) -> type:
    """Class decorator registering `cls` for each of its ``model_types``; a model type can be claimed only once."""
    if getattr(cls, "__abstractmethods__", None):
        raise TypeError(
            f"{cls.__name__} does not declare {sorted(cls.__abstractmethods__)}; every family states its model_types "
            "and one BlockLayout per stack (see docs/contributing/adding_an_architecture.md)."
        )
    if not cls.model_types:
        raise TypeError(f"{cls.__name__} declares no model_types to register under.")
    for model_type in cls.model_types:
        if model_type in _ADAPTERS and _ADAPTERS[model_type] is not cls:
            raise ValueError(
                f"model_type {model_type!r} is already served by {_ADAPTERS[model_type].__name__}; "
                f"{cls.__name__} cannot register it too."
            )
        _ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def registered_adapters() -> dict[str, type]:
    return dict(_ADAPTERS)


#: Per-layer kinds (``config.layer_types`` entries) that are attention layers with heads and a KV cache.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def _non_attention_layers(config: Any) -> str:
    """Why a hybrid stack is refused, for the error: its layer kinds that are not attention (Qwen3-Next's and
    Qwen3.5's ``linear_attention``, Falcon-H1's ``hybrid``), or "" for any other config."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else config
    kinds = sorted({str(t) for t in getattr(text, "layer_types", None) or ()} - ATTENTION_LAYER_TYPES)
    if not kinds:
        return ""
    return (
        f": a hybrid stack whose layer_types include {kinds}, layers that carry a recurrent state instead of "
        "attention heads and a KV cache, which no adapter describes"
    )


def get_adapter(model: nn.Module):
    """The adapter for `model`, bound to that instance.

    A model reloaded from a method's remote-code checkpoint (a ``"<stock>_<variant>"`` subclass of a stock class)
    gets its stock family's adapter, after every registered method has adopted what it stored in the file's own
    modules (`adapters.reloaded`): a reloaded LayerCollapse model gets its α activations back, so it can be trained
    and compressed on.

    Raises:
        UnsupportedArchitectureError: when no adapter serves ``model.config.model_type`` (no silent fallback).
    """
    from .reloaded import adopt_remote_code_, stock_model_type

    config = getattr(model, "config", None)
    model_type = stock_model_type(config)
    cls = _ADAPTERS.get(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"no adapter for model_type {model_type!r} ({type(model).__name__}){_non_attention_layers(config)}. "
            f"Supported model types: {supported_model_types()}. To add one, see "
            "docs/contributing/adding_an_architecture.md."
        )
    if model_type != getattr(config, "model_type", None):  # a remote-code variant of the stock family
        adopt_remote_code_(model)
    return cls(model)
