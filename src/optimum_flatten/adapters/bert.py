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

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import input_device
from .base import (
    ArchitectureAdapter,
    AttentionView,
    BlockView,
    HeadGeometry,
    LinearView,
    MlpView,
    NormView,
    check_unique_indices,
)
from .registry import register_adapter


def keep_head_rows_(block: BlockView, heads: Sequence[int], o_weight: torch.Tensor | None) -> int:
    """Keeps the given heads of a full multi-head attention (q/k/v rows, o columns); returns the new head count.

    `o_weight` (hidden, kept heads x head_dim) replaces the kept columns of the output projection.
    """
    att = block.attention
    geometry = att.geometry
    if geometry.num_kv_heads != geometry.num_heads:
        raise ValueError(f"expected full multi-head attention, got {geometry}.")
    kept = check_unique_indices(heads, geometry.num_heads, "head")
    rows = torch.tensor(geometry.head_channels(kept.tolist()), dtype=torch.long)
    new_o = att.o.weight[:, rows] if o_weight is None else o_weight
    if tuple(new_o.shape) != (att.o.out_features, rows.numel()):
        raise ValueError(
            f"o_weight must be (hidden={att.o.out_features}, kept={rows.numel()}), got {tuple(new_o.shape)}."
        )
    for view in (att.q, att.k, att.v):
        view.set_(view.weight[rows], None if view.bias is None else view.bias[rows])
    att.o.set_(new_o, att.o.bias)
    return kept.numel()


@register_adapter
class BertAdapter(ArchitectureAdapter):
    """Post-LN BERT encoder: learned absolute positions, full multi-head attention, a non-gated GELU MLP.

    Supports layer dropping, parameter merges (attention and MLP linears; each merged block keeps its first
    member's two LayerNorms), and head / MLP-channel pruning. Refuses FlattenGPT (post-LN, see the module
    docstring) and SLEB (no causal LM head).
    """

    model_types = ("bert",)
    default_stack = "encoder"
    layers_path = "encoder.layer"
    capabilities = frozenset({"head_geometry", "layer_drop"})
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "pre_norm": "BERT is post-LN: each LayerNorm normalises the sum of a block's input and update, so norm gains "
        "cannot be folded into the projections and blocks cannot run in parallel on one normalised input; use "
        "shortgpt, laco or sliding_window on BERT",
        "concat_heads": "post-LN BERT blocks cannot be concatenated into one wider block exactly (the LayerNorm after "
        "each residual add is not additive across blocks)",
        "gated_mlp": "BERT's MLP is intermediate.dense -> GELU -> output.dense without a gate projection",
    }
    #: What a parameter merge combines: attention q/k/v, its output dense, and the MLP denses. The LayerNorms
    #: (``attention.output.LayerNorm``, ``output.LayerNorm``) are left out and stay those of the first member; in a
    #: post-LN block they set the scale of the stream every later block reads, so averaging them is not a merge of
    #: the block's function.
    mergeable_prefixes: ClassVar[tuple[str, ...]] = (
        "attention.self.",
        "attention.output.dense.",
        "intermediate.dense.",
        "output.dense.",
    )
    #: Methods that apply to post-LN BERT, named in refusals.
    applicable_methods: ClassVar[str] = "shortgpt, laco, sliding_window"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.config, "is_decoder", False) or getattr(self.config, "add_cross_attention", False):
            raise UnsupportedArchitectureError(
                "BertAdapter serves bidirectional BERT encoders, got a config with is_decoder="
                f"{getattr(self.config, 'is_decoder', False)}, add_cross_attention="
                f"{getattr(self.config, 'add_cross_attention', False)} (causal mask, KV cache, cross-attention are "
                "not bound here). Compress an encoder BERT (is_decoder=False)."
            )

    # ----------------------------------------------------------------- reading
    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        """None: a post-LN stack ends in its last block's ``output.LayerNorm``."""
        return None

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """None for every BERT head.

        `lm_head` is the causal next-token head that SLEB and ffn_merge's NLL score with. BertForMaskedLM's
        ``cls.predictions`` predicts the token *at* each position (and needs its own transform, which
        ``get_output_embeddings`` leaves out), so it does not count; the pooler and classifiers are not LM heads.
        """
        return None

    def position_embeddings(self) -> nn.Module:
        """The learned absolute position table (added with the token-type embeddings before the embedding LN)."""
        return self.base_model().embeddings.position_embeddings

    def block_view(self, module: nn.Module, index: int) -> BlockView:
        attn = module.attention
        head_dim = attn.self.attention_head_size
        q = LinearView(attn.self, "query")
        return BlockView(
            index=index,
            module=module,
            norm_position="post",
            # Post-LN: attn_norm follows the attention residual add, mlp_norm the MLP residual add.
            attn_norm=NormView(attn.output.LayerNorm, "layer"),
            mlp_norm=NormView(module.output.LayerNorm, "layer"),
            attention=AttentionView(
                q=q,
                k=LinearView(attn.self, "key"),
                v=LinearView(attn.self, "value"),
                o=LinearView(attn.output, "dense"),
                geometry=HeadGeometry.of(q, q, head_dim),  # multi-head: one key/value head per query head
                position_scheme="learned",
                module=attn,
            ),
            mlp=MlpView(
                up=LinearView(module.intermediate, "dense"),
                gate=None,
                down=LinearView(module.output, "dense"),
                activation=module.intermediate.intermediate_act_fn,
                module=module,
            ),
        )

    # ---------------------------------------------------------------- mutating
    def build_concat_block(self, members: Sequence[BlockView]) -> nn.Module:
        self.require({"pre_norm", "concat_heads"}, "flattengpt")
        raise AssertionError("unreachable")

    def keep_heads_(
        self, block: BlockView, kv_head_indices: Sequence[int], o_weight: torch.Tensor | None = None
    ) -> None:
        """Keeps the given heads (BERT has no GQA: every head has its own key and value)."""
        num_heads = keep_head_rows_(block, kv_head_indices, o_weight)
        self_attention = block.attention.module.self
        # transformers 5.23 reshapes with attention_head_size; the other two are informational, kept right.
        self_attention.num_attention_heads = num_heads
        self_attention.all_head_size = num_heads * self_attention.attention_head_size

    def collapsed_stock_config(self) -> dict[str, Any]:
        """``intermediate_size = hidden_size`` and ``hidden_act = "linear"`` (transformers' identity
        ``LinearActivation`` in ACT2FN); the export writes ``output.dense`` as the identity.

        Raises:
            ValueError: the model has a prediction head whose transform also reads ``hidden_act``
                (``BertForMaskedLM``, ``BertForPreTraining``: ``cls.predictions.transform``, checked on 5.23), which
                ``"linear"`` would change; the encoder alone (``model.bert``) or a pooler/classifier head has none.
        """
        heads = [name for name, module in self.model.named_modules() if hasattr(module, "transform_act_fn")]
        if heads:
            raise ValueError(
                f"a stock BERT checkpoint of a fully collapsed model sets hidden_act='linear', but {heads} of this "
                f"{type(self.model).__name__} also read hidden_act (got {self.config.hidden_act!r}), so the reloaded "
                "head would compute something else. Export the encoder alone (save model.bert, a BertModel), or a "
                "model whose heads do not read hidden_act (BertForSequenceClassification, BertForTokenClassification)."
            )
        return {"intermediate_size": self.config.hidden_size, "hidden_act": "linear"}

    def reindex_(self, stack: str = "encoder") -> None:
        """Renumbers ``attention.self.layer_idx``; an encoder's maths does not depend on it (only a cache would)."""
        for i, layer in enumerate(self.layers(stack)):
            layer.attention.self.layer_idx = i

    # -------------------------------------------------------------- validating
    def validate(self) -> None:
        layers = self.layers()
        config = self.config
        problems = self.layer_count_problems()
        for i, layer in enumerate(layers):
            view = self.block_view(layer, i)
            g = view.attention.geometry
            if g.num_heads != config.num_attention_heads or g.num_heads * g.head_dim != config.hidden_size:
                problems.append(f"layer {i} has {g.num_heads} heads of {g.head_dim}")
            if layer.attention.self.layer_idx != i:
                problems.append(f"layer {i} has layer_idx {layer.attention.self.layer_idx}")
            if problem := self.mlp_width_problem(view, config.intermediate_size, "intermediate_size"):
                problems.append(problem)
        if problems:
            raise ValueError("compressed model is inconsistent with its config: " + "; ".join(problems))
        self._check_forward()

    @torch.no_grad()
    def _check_forward(self) -> None:
        """One tiny padded forward of the encoder runs and gives finite states of the right shape."""
        device = input_device(self.model)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1, self.config.vocab_size, (2, 6), generator=generator).to(device)
        mask = torch.ones_like(ids)
        mask[1, 4:] = 0
        base = self.base_model()
        was_training = base.training
        base.eval()
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        base.train(was_training)
        if tuple(hidden.shape) != (2, 6, self.config.hidden_size) or not torch.isfinite(hidden).all():
            raise ValueError(f"the compressed encoder's forward gave states of shape {tuple(hidden.shape)} or NaN/inf.")
