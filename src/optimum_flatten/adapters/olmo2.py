"""OLMo-2: no norm before the sublayers, one after each (before the residual add), q/k norms over the projections.

Module layout bound here (transformers 5.x, checked on 5.24): ``self_attn.{q,k,v,o}_proj`` with ``q_norm`` /
``k_norm`` RMSNorms over the whole q and k projections, ``mlp.{gate,up,down}_proj``, and ``post_attention_layernorm``
/ ``post_feedforward_layernorm`` on each sublayer's output; the layout names those two as its norms and says
``norm_position="post"``, so the checks that need a norm before each sublayer refuse the stack.

Only layer drops apply. Besides the merges ruled out by post-sublayer norms (see `adapters.gemma`), compensation is
not exact: the MLP reads the raw stream, and SiLU(αx) is not α·SiLU(x), so scaling the stream changes its output.
"""

from __future__ import annotations

from typing import ClassVar

from .layout import AttentionLayout, BlockLayout
from .post_norm import POST_SUBLAYER_NORM_REASONS, PostSublayerNormAdapter
from .registry import register_adapter

OLMO2_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    attn_norm="post_attention_layernorm",
    mlp_norm="post_feedforward_layernorm",
    norm_position="post",
)


@register_adapter
class Olmo2Adapter(PostSublayerNormAdapter):
    """OLMo-2 decoders: layer drops, ffn_merge and the diagonal bridge."""

    model_types = ("olmo2",)
    capabilities = PostSublayerNormAdapter.capabilities - {"stream_scale"}
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        **POST_SUBLAYER_NORM_REASONS,
        "stream_scale": "the MLP reads the residual stream without a norm, so scaling the stream changes its output",
    }
    layouts = (OLMO2_LAYOUT,)
    post_norms = ("post_attention_layernorm", "post_feedforward_layernorm")
