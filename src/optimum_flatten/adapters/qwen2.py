"""Qwen2 / Qwen2.5 (q/k/v biases, per-layer sliding-window types) and Qwen3 (per-head q_norm/k_norm).

Module layout bound here (transformers 5.x, checked on 5.23): the LLaMA layout plus, for Qwen2,
``config.layer_types`` read by the model forward at each position (``config.layer_types[i]`` picks the mask) and
``max_window_layers`` from which those types were derived; for Qwen3, ``self_attn.q_norm`` / ``k_norm`` RMSNorms
over the head dimension with one gain shared by all heads of a layer.
"""

from __future__ import annotations

from typing import ClassVar

from .base import PRE_NORM_CAPABILITIES
from .llama import LlamaAdapter
from .registry import register_adapter


@register_adapter
class Qwen2Adapter(LlamaAdapter):
    """The LLaMA block with q/k/v biases; ``layer_types`` and ``max_window_layers`` are rewritten by the shared
    per-layer mechanism (`adapters.per_layer`): the boundary stays on the same original layers."""

    model_types = ("qwen2",)


@register_adapter
class Qwen3Adapter(LlamaAdapter):
    """Qwen3 blocks can be dropped or merged whole, but not concatenated head-wise.

    Each layer normalises queries and keys per head with one shared gain vector (q_norm, k_norm) *after* the
    projection. A concatenated block would need two different gains in one attention module, and the gain cannot
    be folded into the projection because the RMS is taken after it; with RoPE mixing dimension pairs, folding it
    into the other side of q·k is not exact either.
    """

    model_types = ("qwen3",)
    capabilities = (PRE_NORM_CAPABILITIES - {"concat_heads"}) | {"gated_mlp"}
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "concat_heads": "Qwen3's per-head q_norm/k_norm share one gain per layer, so two layers' heads cannot "
        "be concatenated into one attention module exactly",
    }
