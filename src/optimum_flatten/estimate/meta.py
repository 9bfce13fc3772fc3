"""The model an estimate reads, built from its config.json alone on the meta device: every shape, no storage.

`estimate` never loads weights: the dense model is built on meta from its config (a folder, a Hub id's config.json,
a bundled model's), and the shape the healing would train is that model with its layers dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..adapters.base import ArchitectureAdapter
from ..utils.loading import model_class_for, one_line, resolve_model_source

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def single_stack(adapter: ArchitectureAdapter) -> str:
    """The model's one stack of blocks (an estimate models one stack, as a compression compresses one)."""
    stacks = adapter.stacks()
    if len(stacks) != 1:
        raise ValueError(
            f"this {type(adapter.model).__name__} has the stacks {stacks}; say which one the estimate is for "
            "(stack=..., estimate --stack), as the compression compresses one at a time."
        )
    return stacks[0]


def meta_model(source: str, dtype: str = "float32", trust_remote_code: bool = False) -> nn.Module:
    """The model of `source` built from its config on the meta device: every shape, no storage, nothing read but
    config.json (a bundled model's config comes from its cached conversion or its GGUF metadata)."""
    import transformers

    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}.")
    config = read_config(source, trust_remote_code)
    auto_map = getattr(config, "auto_map", None) or {}
    with torch.device("meta"):
        if trust_remote_code and auto_map:
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype), trust_remote_code=True
            )
        else:
            cls = model_class_for(config)
            build = cls.from_config if hasattr(cls, "from_config") else cls._from_config  # Auto class or concrete
            model = build(config, dtype=getattr(torch, dtype))
    return model.eval()


def compressed_shape_(model: nn.Module, num_layers_to_remove: int) -> nn.Module:
    """`model` (on meta) with the last `num_layers_to_remove` layers of its one stack dropped, its config saying so:
    the shape the healing trains. Every method keeps the blocks' widths (a drop, a merge, a fold into a projection),
    so the count of layers is what the healing's state and activations follow, not which layers went."""
    adapter = get_adapter(model)
    stack = single_stack(adapter)
    layers = len(adapter.layers(stack))
    adapter.delete_layers_(stack, range(layers - num_layers_to_remove, layers))
    model.config.get_text_config().num_hidden_layers = layers - num_layers_to_remove
    return model


def read_config(source: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a folder, Hub id or bundled name (one-line errors, as the other commands)."""
    import transformers

    from .. import bundled

    if source in bundled.BUNDLED_MODELS:
        return bundled.bundled_config(source)
    path = resolve_model_source(source)
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config of {source!r}: {one_line(error)}") from error
