"""Gemma 2 and Gemma 3 (text): pre-norm blocks with a second norm *after* each sublayer, ``1 + weight`` gains.

Module layout bound here (transformers 5.x, checked on 5.24): the LLaMA names plus ``pre_feedforward_layernorm``
(the norm the MLP reads) and ``post_attention_layernorm`` / ``post_feedforward_layernorm`` applied to each
sublayer's output before the residual add; ``Gemma3`` adds per-head ``q_norm`` / ``k_norm``. Each attention module
keeps its own ``sliding_window`` from ``config.layer_types[layer_idx]`` at construction, and the model picks each
layer's mask from ``config.layer_types``: both follow the kept layers (the list is sliced by `adapters.per_layer`).

What the post-sublayer norms rule out and what stays exact (compensation, the diagonal bridge) is the same for every
family that has them: `adapters.post_norm`. Gemma's norms multiply by ``1 + weight``, so its gains scale as
``(1 + w)·α − 1`` (`GemmaAdapter.scale_norm_`).

``Gemma3ForConditionalGeneration`` (model_type ``gemma3``) holds the same text stack under
``model.language_model`` beside a vision tower and projector, which no method touches; its config keeps the stack's
keys (layer count, ``layer_types``, head counts, widths) in the nested ``text_config``, which `stack_config` finds,
so every per-layer field is rewritten there and the top-level config is left as it is.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .layout import AttentionLayout, BlockLayout
from .post_norm import PostSublayerNormAdapter
from .registry import register_adapter

GEMMA_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    mlp_norm="pre_feedforward_layernorm",  # post_attention_layernorm normalises the attention output instead
)


@register_adapter
class GemmaAdapter(PostSublayerNormAdapter):
    """Gemma 2 / Gemma 3 text stacks: layer drops, compensation and the diagonal bridge; merges refused."""

    model_types = ("gemma2", "gemma3_text")
    layouts = (GEMMA_LAYOUT,)
    post_norms = ("post_attention_layernorm", "post_feedforward_layernorm")

    def scale_norm_(self, module: nn.Module, factor: float | torch.Tensor) -> None:
        """Gemma's RMSNorm multiplies by ``1 + weight`` (transformers 5.x ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``)."""
        module.weight.data.copy_((1.0 + module.weight.data.float()) * factor - 1.0)


#: The Gemma 3 text stack inside the image-text model: paths from ``Gemma3Model`` (the ``model`` base-model prefix).
GEMMA3_MULTIMODAL_LAYOUT = dataclasses.replace(
    GEMMA_LAYOUT, layers="language_model.layers", final_norm="language_model.norm"
)


@register_adapter
class Gemma3MultimodalAdapter(GemmaAdapter):
    """The text stack of ``Gemma3ForConditionalGeneration``: what applies to ``gemma3_text`` applies here; the
    vision tower and the projector stay untouched."""

    model_types = ("gemma3",)
    layouts = (GEMMA3_MULTIMODAL_LAYOUT,)

    def base_model(self, stack: str | None = None) -> nn.Module:
        """The text model: calibration runs text only, so the vision path and its image masks stay out of it."""
        return self._root(stack).language_model
