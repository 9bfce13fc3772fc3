"""BERT encoders (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``, ...): post-LayerNorm blocks.

Module layout bound here (transformers 5.x, checked on 5.23, ``models/bert/modeling_bert.py``): the encoder is
``model.bert.encoder.layer[i]`` (``model.encoder.layer[i]`` for a bare ``BertModel``), a ``BertLayer`` with

* ``attention.self.{query, key, value}`` (``BertSelfAttention``; it reshapes with ``attention_head_size`` and keeps
  ``num_attention_heads`` / ``all_head_size`` as informational attributes, ``layer_idx`` for the decoder cache),
* ``attention.output.dense`` then ``attention.output.LayerNorm(dense(x) + residual)``,
* ``intermediate.dense`` -> ``intermediate.intermediate_act_fn``, then ``output.dense`` and
  ``output.LayerNorm(dense(x) + residual)``.

BERT is **post-LN**: each LayerNorm sits after its residual add, so the stream between blocks is always normalised
and no norm reads a block's input. Consequences:

* No final norm (`final_norm` is None): the last block already ends in a LayerNorm; methods comparing final states
  use the last hidden state.
* FlattenGPT is refused. Its flatten step folds the norm gains into the projections that *read* the norm and runs
  several blocks in parallel on one normalised input; a post-LN block normalises the *sum* of its input and its
  update, which is neither foldable into q/k/v nor additive across blocks (`missing_capability_reasons`).
* The block's "residual stream" that ShortGPT compares is the normalised layer output.

``BertModel.forward`` takes ``input_ids``, ``attention_mask``, ``token_type_ids`` (zeros when omitted, which is
what single-segment calibration text is) and ``use_cache`` (forced off unless ``is_decoder``), so the default
`ArchitectureAdapter.forward_inputs` fits and is not overridden. ``BertEncoder`` passes the mask and
``encoder_hidden_states`` to each layer positionally; the calibration recorder names them through the layer's
signature. Decoder BERT (``is_decoder=True``, ``BertLMHeadModel``, cross-attention) is refused at construction.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import input_device
from .base import ArchitectureAdapter
from .checks import check_encoder_forward
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .post_ln import post_ln_reasons
from .registry import register_adapter

#: The BertLayer. Post-LN: ``attn_norm`` follows the attention residual add, ``mlp_norm`` the MLP residual add. 5.23
#: reshapes with ``attention_head_size``; ``num_attention_heads`` and ``all_head_size`` are informational, kept right.
#: A parameter merge combines attention q/k/v, its output dense and the MLP denses; the LayerNorms
#: (``attention.output.LayerNorm``, ``output.LayerNorm``) stay those of the first member: in a post-LN block they set
#: the scale of the stream every later block reads, so averaging them is not a merge of the block's function.
BERT_LAYOUT = BlockLayout(
    stack="encoder",
    layers="encoder.layer",
    attention=AttentionLayout(
        path="attention",
        q="self.query",
        k="self.key",
        v="self.value",
        o="output.dense",
        head_dim="self.attention_head_size",
        layer_idx="self.layer_idx",
        position_scheme="learned",
        size_attributes=(("self.num_attention_heads", "heads"), ("self.all_head_size", "q_width")),
    ),
    mlp=MlpLayout(
        path="", up="intermediate.dense", gate=None, down="output.dense", activation="intermediate.intermediate_act_fn"
    ),
    attn_norm="attention.output.LayerNorm",
    mlp_norm="output.LayerNorm",
    norm_kind="layer",
    norm_position="post",
    final_norm=None,  # a post-LN stack ends in its last block's output.LayerNorm
    lm_head=False,  # BertForMaskedLM's head predicts the token *at* each position: no causal next-token head
    mergeable_prefixes=("attention.self.", "attention.output.dense.", "intermediate.dense.", "output.dense."),
)


@register_adapter
class BertAdapter(ArchitectureAdapter):
    """Post-LN BERT encoder: learned absolute positions, full multi-head attention, a non-gated GELU MLP.

    Supports layer dropping, parameter merges (attention and MLP linears; each merged block keeps its first
    member's two LayerNorms), and head / MLP-channel pruning. Refuses FlattenGPT (post-LN, see the module
    docstring) and SLEB (no causal LM head).
    """

    model_types = ("bert",)
    layouts = (BERT_LAYOUT,)
    capabilities = frozenset({"head_geometry", "layer_drop", "parameter_merge", "dense_mlp"})
    #: ``BertForMaskedLM``/``BertForPreTraining``'s ``cls.predictions.transform`` reads ``hidden_act`` (5.23).
    activation_config_readers = ("transform_act_fn",)
    missing_capability_reasons: ClassVar[dict[str, str]] = post_ln_reasons(
        "BERT", "intermediate.dense -> GELU -> output.dense", advice="use shortgpt, laco or sliding_window on BERT"
    )

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.config, "is_decoder", False) or getattr(self.config, "add_cross_attention", False):
            raise UnsupportedArchitectureError(
                "BertAdapter serves bidirectional BERT encoders, got a config with is_decoder="
                f"{getattr(self.config, 'is_decoder', False)}, add_cross_attention="
                f"{getattr(self.config, 'add_cross_attention', False)} (causal mask, KV cache, cross-attention are "
                "not bound here). Compress an encoder BERT (is_decoder=False)."
            )

    def position_embeddings(self) -> nn.Module:
        """The learned absolute position table (added with the token-type embeddings before the embedding LN)."""
        return self.base_model().embeddings.position_embeddings

    # -------------------------------------------------------------- validating
    def check_forward(self) -> None:
        """One tiny padded forward of the encoder runs and gives finite states of the right shape."""
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1, self.config.vocab_size, (2, 6), generator=generator).to(input_device(self.model))
        mask = torch.ones_like(ids)
        mask[1, 4:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        check_encoder_forward(self.base_model(), inputs, (2, 6, self.config.hidden_size), "encoder")
