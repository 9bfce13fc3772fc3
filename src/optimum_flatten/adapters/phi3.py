"""Phi-3 and Phi-4: the LLaMA block behind two fused projections, ``qkv_proj`` and ``gate_up_proj``.

Module layout bound here (transformers 5.x, checked on 5.24): ``model.model.layers[i]`` has ``input_layernorm`` /
``post_attention_layernorm`` (RMSNorm) before each sublayer, ``self_attn.qkv_proj`` (one bias-free Linear whose rows
are [q; k; v], k and v of ``num_key_value_heads`` heads each), ``self_attn.o_proj``, and ``mlp.gate_up_proj`` (rows
[gate; up], split by ``chunk(2)``), ``mlp.activation_fn`` and ``mlp.down_proj``. The residual dropouts are identities
in eval. The fused maps are read and written through the same part views as Baichuan's ``W_pack``
(`base.PackedPartView`): every method sees separate q, k, v, gate and up maps, so every method applies.

One storage quirk shapes this adapter: the attention splits ``qkv_proj``'s output at
``config.num_attention_heads * head_dim`` (the shared model config) and at ``self.num_key_value_heads * head_dim``.
The key/value count is a size attribute kept in line with the weights; the query width is not the module's own, so
a block whose query heads differ from the config's (a concatenated block before FlattenGPT or CoMe prunes it back)
gets a private copy of the config with its own count, and the shared config again once the count matches
(`_sync_sizes`). Saved checkpoints therefore always describe uniform layers.
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from .base import PRE_NORM_CAPABILITIES
from .layout import AttentionLayout, MlpLayout
from .llama import LLAMA_LAYOUT, LlamaAdapter
from .registry import register_adapter

PHI3_LAYOUT = dataclasses.replace(
    LLAMA_LAYOUT,
    attention=AttentionLayout(
        fused_qkv="qkv_proj",
        fused_kv_heads="num_key_value_heads",
        kv_heads_key="num_key_value_heads",
        size_attributes=(("num_key_value_heads", "kv_heads"),),
    ),
    mlp=MlpLayout(fused_gate_up="gate_up_proj", activation="activation_fn"),
)


@register_adapter
class Phi3Adapter(LlamaAdapter):
    """Pre-norm decoder with RoPE (partial where ``partial_rotary_factor`` < 1), RMSNorm, a SwiGLU MLP and fused
    projections: layer drops, compensation, ReplaceMe, parameter merges, FlattenGPT, CoMe and ffn_merge."""

    model_types = ("phi3",)
    capabilities = PRE_NORM_CAPABILITIES | {"gated_mlp"}
    layouts = (PHI3_LAYOUT,)

    def _sync_sizes(self, module: nn.Module) -> None:
        """The size attributes, then the query width the attention reads from its config (see the module doc)."""
        super()._sync_sizes(module)
        attention = self.block_view(module, -1).attention
        shared = self.stack_config()
        heads = attention.q.out_features // attention.geometry.head_dim
        if heads == shared.num_attention_heads:
            attention.module.config = shared
        elif attention.module.config.num_attention_heads != heads:
            private = copy.copy(shared)
            private.num_attention_heads = heads
            attention.module.config = private
