"""ShortGPT (Men et al., 2024): drop the layers with the lowest Block Influence.

BI_i = 1 − E_tokens cos(h_i, h_{i+1}), where h_i enters layer i and h_{i+1} leaves it, measured on the residual
stream before the final norm for every layer including the last, padding masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import LayerPlan, MethodConfig
from ..ops import top_k_indices
from .base import CompressionMethod, MethodContext, apply_layer_drop_
from .registry import register_method


@dataclass
class ShortGPTConfig(MethodConfig):
    """ShortGPT has no options: the Block Influence score fully decides the plan."""


def block_influence(adapter: Any, context: MethodContext) -> torch.Tensor:
    """(L,) float64 Block Influence of every layer of the stack, one layer-by-layer pass (two boundaries alive)."""
    states = context.new_states(adapter, keep=())
    scores = torch.zeros(states.num_layers, dtype=torch.float64)
    with context.timer("selection"), context.progress_bar(states.num_layers, "block influence") as bar:
        for i, before, after in states.walk():
            scores[i] = 1.0 - states.mean_cosine(before, after, tokens="all")
            bar.set_description(f"block {i + 1}/{states.num_layers}: block influence")
            bar.update()
    return scores


@register_method("shortgpt")
class ShortGPTMethod(CompressionMethod):
    config_class = ShortGPTConfig
    requires_calibration = True
    required_capabilities = frozenset({"layer_drop"})

    def plan(self, adapter: Any, context: MethodContext, num_to_remove: int) -> LayerPlan:
        scores = block_influence(adapter, context)
        num_layers = scores.numel()
        kept = top_k_indices(scores, num_layers - num_to_remove)
        context.report["block_influence"] = [round(float(s), 6) for s in scores]
        return LayerPlan(
            num_layers=num_layers,
            groups=[(i,) for i in kept],
            stack=context.stack,
            scores=[float(s) for s in scores],
        )

    def apply_(self, adapter: Any, plan: LayerPlan, context: MethodContext) -> None:
        apply_layer_drop_(adapter, plan)
