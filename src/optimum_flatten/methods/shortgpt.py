"""ShortGPT (Men et al., 2024): drop the layers with the lowest Block Influence.

BI_i = 1 − E_tokens cos(h_i, h_{i+1}), where h_i enters layer i and h_{i+1} leaves it, measured on the residual
stream before the final norm for every layer including the last, padding masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import LayerPlan, MethodConfig
from ..ops import masked_cosine_sum, top_k_indices
from .base import CompressionMethod, MethodContext, apply_layer_drop_
from .registry import register_method


@dataclass
class ShortGPTConfig(MethodConfig):
    """ShortGPT has no options: the Block Influence score fully decides the plan."""


def block_influence(adapter: Any, context: MethodContext) -> torch.Tensor:
    """(L,) float64 Block Influence of every layer of the stack, one layer-by-layer pass."""
    runner = context.new_runner(adapter)
    layers = adapter.layers(context.stack)
    scores = torch.zeros(len(layers), dtype=torch.float64)
    current = runner.inputs
    with context.timer("selection"), context.progress_bar(len(layers), "block influence") as bar:
        for i, layer in enumerate(layers):
            nxt = runner.run(layer, i, current)
            total, count = 0.0, 0
            for a, b, mask in zip(current, nxt, runner.masks, strict=True):
                s, c = masked_cosine_sum(a, b, mask)
                total, count = total + s, count + c
            scores[i] = 1.0 - total / count
            current = nxt
            bar.set_description(f"block {i + 1}/{len(layers)}: block influence")
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
