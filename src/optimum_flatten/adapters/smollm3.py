"""SmolLM3 and Granite: the LLaMA block with per-layer or per-model scalars, declared as data.

Module layout bound here (transformers 5.x, checked on 5.24): the LLaMA names.

- **SmolLM3** skips RoPE on the layers where ``config.no_rope_layers[i] == 0``; each attention module keeps its own
  ``use_rope`` from construction, and `adapters.per_layer` slices the list, so both follow the kept layers. A merge of
  a RoPE and a NoPE layer is refused there.
- **Granite** multiplies the embeddings by ``embedding_multiplier``, each sublayer's output by
  ``residual_multiplier`` before the add, the attention scores by ``attention_multiplier`` and divides the logits by
  ``logits_scaling``. Scaling o_proj/down_proj (compensation) or concatenating blocks commutes with those scalars;
  a ReplaceMe map is fitted on the MLP's output times the residual multiplier (what the stream receives,
  `mlp_output_multiplier`) and folded into down_proj as everywhere (the multiplier commutes with it).
"""

from __future__ import annotations

from torch import nn

from .llama import LlamaAdapter
from .registry import register_adapter


@register_adapter
class SmolLM3Adapter(LlamaAdapter):
    model_types = ("smollm3",)


@register_adapter
class GraniteAdapter(LlamaAdapter):
    model_types = ("granite",)

    def mlp_output_multiplier(self, module: nn.Module, index: int) -> float:
        return float(self.config.residual_multiplier)
