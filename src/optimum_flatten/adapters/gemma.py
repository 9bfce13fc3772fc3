"""Gemma 2 and Gemma 3 (text): pre-norm blocks with a second norm *after* each sublayer, ``1 + weight`` gains.

Module layout bound here (transformers 5.x, checked on 5.24): the LLaMA names plus ``pre_feedforward_layernorm``
(the norm the MLP reads) and ``post_attention_layernorm`` / ``post_feedforward_layernorm`` applied to each
sublayer's output before the residual add; ``Gemma3`` adds per-head ``q_norm`` / ``k_norm``. Each attention module
keeps its own ``sliding_window`` from ``config.layer_types[layer_idx]`` at construction, and the model picks each
layer's mask from ``config.layer_types``: both follow the kept layers (the list is sliced by `adapters.per_layer`).

What the post-sublayer norms rule out (`missing_capability_reasons`): the sublayer's output is normalised before it
reaches the stream, so the output of two layers' heads concatenated is not the sum of their normalised outputs
(FlattenGPT, CoMe), parameter differences do not add up to the summed updates (LaCo, Sliding-Window Merging), and a
map folded into ``down_proj`` is undone by the norm that follows it (ReplaceMe, ``linear_replacement``). Compensation
stays exact: every sublayer reads the stream through a scale-invariant norm, and its writes are scaled through the
post-norm gains (`scale_stream_writes_`).

``Gemma3ForConditionalGeneration`` (model_type ``gemma3``) holds the same text stack under
``model.language_model`` beside a vision tower and projector, which no method touches; its config keeps the stack's
keys (layer count, ``layer_types``, head counts, widths) in the nested ``text_config``, which `stack_config` finds,
so every per-layer field is rewritten there and the top-level config is left as it is.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from .base import ArchitectureAdapter
from .layout import AttentionLayout, BlockLayout
from .registry import register_adapter

GEMMA_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    mlp_norm="pre_feedforward_layernorm",  # post_attention_layernorm normalises the attention output instead
)

#: Why families that normalise each sublayer's output before the residual add lack the merges' capabilities.
POST_SUBLAYER_NORM_REASONS: dict[str, str] = {
    "pre_norm": "a norm follows each sublayer's output before the residual add, so norm folding and the sum of "
    "concatenated layers' outputs are not exact",
    "concat_heads": "the post-sublayer norm of a concatenated block would normalise the members' summed outputs, "
    "not each one",
    "parameter_merge": "parameter differences approximate summed residual updates, and a post-sublayer norm "
    "rescales each update to one layer's magnitude",
    "down_fold": "a linear map folded into down_proj is undone by the norm applied after it (estimator 'diagonal' "
    "folds a per-channel map into that norm's gain instead)",
}


@register_adapter
class GemmaAdapter(ArchitectureAdapter):
    """Gemma 2 / Gemma 3 text stacks: layer drops and compensation; merges refused (post-sublayer norms)."""

    model_types = ("gemma2", "gemma3_text")
    capabilities = frozenset({"head_geometry", "gated_mlp", "layer_drop", "dense_mlp", "stream_scale"})
    mlp_output_norm = "post_feedforward_layernorm"  # a diagonal bridge folds into its gain (estimator 'diagonal')
    missing_capability_reasons: ClassVar[dict[str, str]] = POST_SUBLAYER_NORM_REASONS
    layouts = (GEMMA_LAYOUT,)

    def scale_stream_writes_(self, module: nn.Module, index: int, factor: float) -> None:
        """The sublayers write through their post-norms: scaling those gains scales the writes exactly."""
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            self.scale_norm_(getattr(module, name), factor)

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
