"""LLaMA-family decoders: LLaMA-2, LLaMA-3 (GQA), SmolLM, Mistral.

Module layout bound here (transformers 5.x, checked on 5.23): ``model.model.layers[i]`` is a decoder layer with
``input_layernorm`` / ``post_attention_layernorm`` (RMSNorm), ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``; query head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)`` (the
``repeat_kv`` layout), and the KV cache is addressed by ``self_attn.layer_idx``. Everything the adapter does follows
from `LLAMA_LAYOUT`.
"""

from __future__ import annotations

from .base import PRE_NORM_CAPABILITIES, ArchitectureAdapter
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .registry import register_adapter

#: The LLaMA block; Qwen2/3 and Baichuan start from it. ``mlp.intermediate_size`` is informational in 5.23 but kept
#: right for readers.
LLAMA_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    mlp=MlpLayout(size_attributes=(("intermediate_size", "width"),)),
)


@register_adapter
class LlamaAdapter(ArchitectureAdapter):
    """Pre-norm decoder with RoPE, RMSNorm and a SwiGLU MLP; q/k/v biases optional (Qwen2 has them)."""

    model_types = ("llama", "mistral")
    capabilities = PRE_NORM_CAPABILITIES | {"gated_mlp"}
    layouts = (LLAMA_LAYOUT,)
