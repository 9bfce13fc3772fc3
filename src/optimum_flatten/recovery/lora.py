"""Mode 'lora' of the healing: PEFT adapters on the projections the architecture adapter exposes, merged back
into plain weights after training (`recovery.trainer`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in every block: attention's q, k, v and o,
    and the MLP's up, gate and down. On a model with a mixture-of-experts block, attention's only: its experts are
    no single projection (transformers 5 fuses them into 3-D parameters), and peft maps every target named like an
    MLP projection onto those fused parameters (its v4-to-v5 conversion), which it adapts only without dropout."""
    adapter = get_adapter(model)
    attention, mlp, mixture = set(), set(), False
    for block in adapter.blocks():
        attention.update(id(getattr(block.attention, name).module) for name in ("q", "k", "v", "o"))
        for name in ("up", "gate", "down"):
            try:
                view = getattr(block.mlp, name)
                if view is not None:
                    mlp.add(id(view.module))
            except AttributeError:  # a mixture-of-experts block
                mixture = True
    wanted = attention if mixture else attention | mlp
    return sorted({name.split(".")[-1] for name, module in model.named_modules() if id(module) in wanted})


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
