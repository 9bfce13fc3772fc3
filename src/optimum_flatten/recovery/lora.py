"""Mode 'lora' of the healing: PEFT adapters on the projections the architecture adapter exposes, merged back
into plain weights after training (`recovery.trainer`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in the first block."""
    adapter = get_adapter(model)
    block = adapter.blocks()[0]
    views = [block.attention.q, block.attention.k, block.attention.v, block.attention.o, block.mlp.up, block.mlp.down]
    if block.mlp.gate is not None:
        views.append(block.mlp.gate)
    wanted = {id(v.module) for v in views}
    names = {name.split(".")[-1] for name, module in block.module.named_modules() if id(module) in wanted}
    return sorted(names)


def wrap_lora(model: nn.Module, config: RecoveryConfig) -> tuple[nn.Module, Any]:
    """The peft-wrapped model and its LoraConfig."""
    from peft import LoraConfig, get_peft_model  # its presence is checked before any weight changes

    lora = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules or default_target_modules(model),
        layers_to_transform=config.layers_to_transform,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora), lora
