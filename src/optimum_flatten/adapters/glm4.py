"""GLM-4 (``Glm4ForCausalLM``, e.g. GLM-4-9B-0414): pre-norm blocks with a second norm after each sublayer.

Module layout bound here (transformers 5.x, checked on 5.24): ``input_layernorm`` before the attention,
``post_self_attn_layernorm`` on its output before the residual add, ``post_attention_layernorm`` before the MLP and
``post_mlp_layernorm`` on its output (plain RMSNorms: the gain multiplies, unlike Gemma's ``1 + weight``);
``self_attn.{q,k,v,o}_proj`` (q/k/v biases with ``attention_bias``, partial RoPE over half of each head) and
``mlp.gate_up_proj`` (rows [gate; up], split by ``chunk(2)``), ``mlp.activation_fn``, ``mlp.down_proj``.

The block is Gemma's with other names, so the same algebra decides (`adapters.gemma`): layer drops and ffn_merge
apply (ffn_merge reads the fused gate/up through part views), and compensation is exact (both sublayers read the
stream through scale-invariant norms, and their writes scale through the post-norm gains); merges that sum or fold
sublayer outputs are refused with `adapters.post_norm`'s reasons.
"""

from __future__ import annotations

from .layout import AttentionLayout, BlockLayout, MlpLayout
from .post_norm import PostSublayerNormAdapter
from .registry import register_adapter

GLM4_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    mlp=MlpLayout(fused_gate_up="gate_up_proj", activation="activation_fn"),
    # post_attention_layernorm is the norm the MLP reads; post_self_attn_layernorm normalises the attention output.
    mlp_norm="post_attention_layernorm",
)


@register_adapter
class Glm4Adapter(PostSublayerNormAdapter):
    """GLM-4 decoders: layer drops, compensation, ffn_merge and the diagonal bridge; merges refused."""

    model_types = ("glm4",)
    layouts = (GLM4_LAYOUT,)
    post_norms = ("post_self_attn_layernorm", "post_mlp_layernorm")
