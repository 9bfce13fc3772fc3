"""Architecture as data: where a family keeps each part of a block, as mergekit describes architectures.

A `BlockLayout` names the modules of one stack's blocks (paths relative to the block, the attention module or the
MLP module), their storage, where the norms sit, which attributes hold sizes or the layer index, and which config
keys describe the stack. `ArchitectureAdapter` derives everything generic from it: views, renumbering, config
updates, size attributes, validation, merges and device-map keys; an adapter adds only what a layout cannot say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

NormPosition = Literal["pre", "post", "parallel"]
PositionScheme = Literal["rope", "alibi", "learned", "sinusoidal", "none"]
#: What a size attribute must equal: query heads, key/value heads, query width (heads x head_dim) or MLP width.
SizeSource = Literal["heads", "kv_heads", "q_width", "width"]


@dataclass(frozen=True)
class AttentionLayout:
    """An attention module of a block.

    Attributes:
        path: The module, relative to the block (``"self_attn"``, GPT-2's ``"attn"``, BERT's ``"attention"``).
        q, k, v, o: The projections, relative to the attention module (BERT: ``"self.query"``, ``"output.dense"``).
        fused_qkv: One module whose outputs are [q; k; v] (GPT-2's ``c_attn``, Baichuan's ``W_pack``, Phi-3's
            ``qkv_proj``); q, k and v are then parts of it and their own names are not read.
        fused_kv_heads: For a `fused_qkv` whose k and v hold fewer heads than q (Phi-3 under GQA), the attention
            module's attribute with the key/value head count that splits its rows; None: three equal parts.
        head_dim: Attribute holding the head size (BERT: ``"self.attention_head_size"``).
        layer_idx: Attribute holding the cache index that `reindex_` renumbers, None when the layer keeps none.
        position_scheme: How positions enter the attention.
        size_attributes: (attribute, what it must equal) pairs the module keeps next to its weights; they are set
            after every resize (when the module has them) and checked by `validate`.
        heads_key: Config key of the query head count.
        kv_heads_key: Config key of the key/value head count (GQA); None means one per query head.
    """

    path: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    fused_qkv: str | None = None
    fused_kv_heads: str | None = None
    head_dim: str = "head_dim"
    layer_idx: str | None = "layer_idx"
    position_scheme: PositionScheme = "rope"
    size_attributes: tuple[tuple[str, SizeSource], ...] = ()
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None


@dataclass(frozen=True)
class MlpLayout:
    """The feed-forward part of a block.

    Attributes:
        path: The MLP module, relative to the block; ``""`` when its linears sit on the block itself (BERT, Marian).
        up, gate, down, activation: Relative to the MLP module; ``gate`` is None for a non-gated MLP.
        fused_gate_up: One module whose outputs are [gate; up] (Phi-3's and GLM-4's ``gate_up_proj``, split by
            ``chunk(2)``); gate and up are then its halves and their own names are not read.
        size_attributes: As for attention (e.g. LLaMA's ``intermediate_size``).
        width_key: Config key of the MLP width.
        activation_key: Config key naming the activation (what a stock config of a family says it is).
    """

    path: str = "mlp"
    up: str = "up_proj"
    gate: str | None = "gate_proj"
    down: str = "down_proj"
    activation: str = "act_fn"
    fused_gate_up: str | None = None
    size_attributes: tuple[tuple[str, SizeSource], ...] = ()
    width_key: str = "intermediate_size"
    activation_key: str = "hidden_act"


@dataclass(frozen=True)
class BlockLayout:
    """One stack of blocks.

    Attributes:
        stack: The stack's name (``"decoder"``, ``"encoder"``).
        layers: The layer list, relative to the base model (the module under transformers' ``base_model_prefix``).
        attention: The self-attention.
        cross_attention: A second attention over another stack's states (Marian's decoder ``encoder_attn``).
        mlp: The feed-forward part.
        attn_norm, mlp_norm: The norms, relative to the block (for post-norm blocks: after each residual add).
        norm_kind: ``"rms"`` (weight only) or ``"layer"`` (weight and bias).
        norm_position: ``"pre"`` (norms read the stream) or ``"post"`` (norms follow the residual add).
        storage: How linear maps are stored: ``"linear"`` ((out, in) ``nn.Linear``) or ``"conv1d"`` (GPT-2's (in, out)
            ``Conv1D``); `register_storage` binds the views of a storage kind.
        final_norm: The norm after the last layer, relative to the base model; None when the stack ends without one.
        lm_head: Whether the model's output embeddings are a causal next-token head reading this stack.
        layer_count_key: Config key of the stack's layer count.
        mergeable_prefixes: State-dict prefixes a parameter merge combines; None derives them from the attention and
            MLP paths (the norms stay those of the first member).
    """

    stack: str = "decoder"
    layers: str = "layers"
    attention: AttentionLayout = field(default_factory=AttentionLayout)
    cross_attention: AttentionLayout | None = None
    mlp: MlpLayout = field(default_factory=MlpLayout)
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    norm_kind: Literal["rms", "layer"] = "rms"
    norm_position: NormPosition = "pre"
    storage: str = "linear"
    final_norm: str | None = "norm"
    lm_head: bool = True
    layer_count_key: str = "num_hidden_layers"
    mergeable_prefixes: tuple[str, ...] | None = None

    def attentions(self) -> tuple[AttentionLayout, ...]:
        """The self-attention, then the cross-attention if the stack has one."""
        return (self.attention,) if self.cross_attention is None else (self.attention, self.cross_attention)

    def merge_prefixes(self) -> tuple[str, ...]:
        """`mergeable_prefixes`, or the attention modules and the MLP (its linears when it is the block itself)."""
        if self.mergeable_prefixes is not None:
            return self.mergeable_prefixes
        mlp = self.mlp
        linears = [p for p in (mlp.up, mlp.gate, mlp.down) if p is not None]
        return tuple(f"{a.path}." for a in self.attentions()) + (
            (f"{mlp.path}.",) if mlp.path else tuple(f"{p}." for p in linears)
        )
