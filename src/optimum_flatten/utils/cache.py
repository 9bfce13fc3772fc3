"""The KV cache's name in transformers' call convention, which changed within 5.x.

transformers 5.24 renamed the ``past_key_values`` argument and output field to ``cache`` (the old name warns and is
removed in 5.40). The cache checks run a prefill and cached decode steps by keyword, so they ask the model which
name its ``forward`` takes instead of pinning one transformers release.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

_NAMES = ("cache", "past_key_values")


def cache_keyword(forward_owner: nn.Module) -> str:
    """The keyword under which ``forward_owner.forward`` takes the KV cache: ``"cache"`` on transformers >= 5.24,
    ``"past_key_values"`` before (and on remote-code models written for it)."""
    parameters = inspect.signature(forward_owner.forward).parameters
    for name in _NAMES:
        if name in parameters:
            return name
    return _NAMES[1]


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, under whichever field name this transformers release uses."""
    for name in _NAMES:
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None
