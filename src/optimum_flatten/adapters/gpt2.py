"""GPT-2 (``GPT2LMHeadModel``): pre-LayerNorm blocks, learned positions, a GELU MLP and transposed Conv1D storage.

Module layout bound here (transformers 5.x, checked on 5.23, ``models/gpt2/modeling_gpt2.py``):
``model.transformer.h[i]`` is a ``GPT2Block`` with ``ln_1`` / ``ln_2`` (LayerNorm with bias), ``attn`` (a
``GPT2Attention``: ``c_attn`` fusing q, k and v along its output, ``c_proj``) and ``mlp`` (``c_fc`` -> ``act`` ->
``c_proj``, not gated); ``model.transformer.{wte, wpe, ln_f}``; ``model.lm_head`` tied to ``wte``. Every projection
is a ``transformers.pytorch_utils.Conv1D``: its weight is stored (in, out) and it computes ``x @ W + b`` (it always
has a bias). The config names things ``n_layer``, ``n_head``, ``n_embd``, ``n_inner`` (None means 4 * n_embd).

Three quirks shape this adapter:

* Storage. `Conv1DView` shows a Conv1D as an (out, in) map and `PackedConv1DView` shows one part of ``c_attn``
  (columns [q | k | v] of the stored weight); writes rebuild a Conv1D, so a saved checkpoint stays a plain GPT-2.
  ``GPT2Attention.forward`` splits ``c_attn``'s output with ``self.split_size`` (the q width), which every resize
  keeps in line (the layout's size attributes).
* Call convention. ``GPT2Model.forward`` calls each block with ``past_key_values``, the mask and
  ``encoder_hidden_states`` as *positional* arguments (5.23; "for gradient checkpointing"), and a block returns the
  bare hidden state. The calibration recorders must name those positional arguments (see docs/adapters/gpt2.md).
* Layer-index scaling. With ``scale_attn_by_inverse_layer_idx`` the attention scores of layer ``i`` are divided by
  ``i + 1``. In transformers 5.x the attention folds this into ``self.scaling`` once, at construction
  (``head_dim ** -0.5 / (layer_idx + 1)``), and every attention path (eager, ``reorder_and_upcast_attn``'s
  ``baddbmm(alpha=self.scaling)``, SDPA, flash) multiplies q·k by ``self.scaling``. A block moved to another
  position therefore keeps computing its old function in memory, but a reloaded checkpoint rebuilds ``scaling``
  from the new index. `reindex_` compensates exactly: it multiplies the block's query rows (weight and bias) by
  old_scaling / new_scaling and sets ``scaling`` to the value a fresh block at the new index computes, so
  ``(c q)·k · s_new == q·k · s_old`` and the saved model reloads with the same function. Concatenation and
  parameter merges use the same rescaling to bring every member to one scale first.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import onloaded
from .base import PRE_NORM_CAPABILITIES, ArchitectureAdapter
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .registry import register_adapter
from .views import PENDING_PART_SIZES, BlockView, LinearView, PackedPartView, register_storage

#: State-dict names of a block's fused q/k/v projection (the only parameters the layer-index scaling touches).
_QKV_WEIGHT, _QKV_BIAS = "attn.c_attn.weight", "attn.c_attn.bias"


# --------------------------------------------------------------------------------------------------- views
def _new_conv1d(weight_out_in: torch.Tensor, bias: torch.Tensor | None, like: Conv1D) -> Conv1D:
    """A Conv1D computing ``x @ weight_out_in.T + bias``, in `like`'s dtype, device and requires_grad.

    Conv1D always adds a bias, so a missing one becomes zeros (exact). Built on the meta device, so nothing is
    allocated or randomly initialised before the given tensors are assigned.
    """
    out_features, in_features = weight_out_in.shape
    dtype, device = like.weight.dtype, like.weight.device
    if bias is None:
        bias = torch.zeros(out_features, dtype=dtype, device=device)
    with torch.device("meta"):
        new = Conv1D(out_features, in_features)
    requires_grad = like.weight.requires_grad
    new.weight = nn.Parameter(
        weight_out_in.detach().to(device=device, dtype=dtype).T.contiguous(), requires_grad=requires_grad
    )
    new.bias = nn.Parameter(bias.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=requires_grad)
    return new


class Conv1DView(LinearView):
    """A GPT-2 ``Conv1D`` (weight stored (in, out)) seen as an (out, in) linear map.

    `weight` is the transposed storage, a view of the same memory (in-place edits reach the parameter); `set_`
    replaces the module by a new Conv1D, so the shape may change.
    """

    @property
    def module(self) -> Conv1D:
        return getattr(self._parent, self._name)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight.data.T

    @property
    def bias(self) -> torch.Tensor:
        return self.module.bias.data

    def set_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Replaces the map by ``x @ weight.T + bias`` (weight is (out, in)); no bias means a zero bias."""
        _check_linear_args(weight, bias)
        setattr(self._parent, self._name, _new_conv1d(weight, bias, self.module))


class PackedConv1DView(PackedPartView, Conv1DView):
    """One part (q, k or v) of GPT-2's fused ``c_attn``: a block of output columns of the stored (in, 3 * hidden)
    weight, i.e. a row block of the Conv1D's (out, in) view."""


register_storage("conv1d", Conv1DView, PackedConv1DView)

#: The GPT2Block. ``GPT2Attention.forward`` splits c_attn's output with ``split_size`` (the q width); ``num_heads`` is
#: informational there but kept right for readers.
GPT2_LAYOUT = BlockLayout(
    layers="h",
    attention=AttentionLayout(
        path="attn",
        fused_qkv="c_attn",
        o="c_proj",
        position_scheme="learned",
        size_attributes=(("split_size", "q_width"), ("num_heads", "heads")),
    ),
    mlp=MlpLayout(
        up="c_fc", gate=None, down="c_proj", activation="act", width_key="n_inner", activation_key="activation_function"
    ),
    attn_norm="ln_1",
    mlp_norm="ln_2",
    norm_kind="layer",
    storage="conv1d",
    final_norm="ln_f",
)


def _check_linear_args(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D (out, in) matrix, got shape {tuple(weight.shape)}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},) to match the weight, got {tuple(bias.shape)}.")


# ------------------------------------------------------------------------------------------ layer scaling
def expected_scaling(config: object, head_dim: int, layer_idx: int) -> float:
    """The ``scaling`` a fresh ``GPT2Attention`` at `layer_idx` computes (same float operations, same order).

    transformers 5.x: ``1.0``, times ``head_dim ** -0.5`` if ``scale_attn_weights``, divided by
    ``float(layer_idx + 1)`` if ``scale_attn_by_inverse_layer_idx``.
    """
    scaling = 1.0
    if getattr(config, "scale_attn_weights", True):
        scaling = head_dim**-0.5
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scaling /= float(layer_idx + 1)
    return scaling


def _scaled_query(
    weight: torch.Tensor, bias: torch.Tensor, q_width: int, factor: float, columns_are_outputs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a fused q/k/v weight and bias with the query part multiplied by `factor` (in float64).

    Args:
        weight: The fused weight, as stored ((in, out), ``columns_are_outputs=True``) or as an (out, in) view.
        bias: The fused (out,) bias.
        q_width: Number of query outputs (the first part).
        factor: Multiplier of the query part; 1.0 returns exact copies.
        columns_are_outputs: Whether the outputs are the weight's columns (Conv1D storage) or rows.
    """
    weight, bias = weight.clone(), bias.clone()
    if factor == 1.0:
        return weight, bias
    if columns_are_outputs:
        weight[:, :q_width] = (weight[:, :q_width].double() * factor).to(weight.dtype)
    else:
        weight[:q_width] = (weight[:q_width].double() * factor).to(weight.dtype)
    bias[:q_width] = (bias[:q_width].double() * factor).to(bias.dtype)
    return weight, bias


# ------------------------------------------------------------------------------------------------ adapter
@register_adapter
class GPT2Adapter(ArchitectureAdapter):
    """GPT-2: pre-LayerNorm, learned absolute positions, full multi-head attention, a non-gated GELU MLP.

    Concatenation, head and MLP-channel pruning go through the Conv1D views; `reindex_` compensates GPT-2's
    optional layer-index attention scaling exactly instead of refusing it.

    Raises (at construction, before anything is read or changed):
        UnsupportedArchitectureError: for a GPT-2 with cross-attention (``add_cross_attention=True``), whose
            second attention per block and encoder cache are not bound here.
    """

    model_types = ("gpt2",)
    layouts = (GPT2_LAYOUT,)
    capabilities = PRE_NORM_CAPABILITIES
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "gated_mlp": "GPT-2's MLP is c_fc -> GELU -> c_proj without a gate projection",
    }

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.config, "add_cross_attention", False):
            raise UnsupportedArchitectureError(
                "GPT2Adapter serves decoder-only GPT-2, got a config with add_cross_attention=True (each block has a "
                "second, cross-attention module and the cache is an EncoderDecoderCache). Compress the model "
                "without cross-attention, or add cross-attention to the adapter's views and reindex_ first."
            )

    # ----------------------------------------------------------------- reading
    def position_embeddings(self) -> nn.Module:
        """The learned absolute position table ``wpe`` (added to the token embeddings before layer 0)."""
        return self.base_model().wpe

    def expected_mlp_width(self, stack: str | None = None) -> int:
        """The MLP width the config describes: ``n_inner``, or 4 * n_embd when it is None (as GPT2Block does)."""
        inner = getattr(self.config, "n_inner", None)
        return inner if inner is not None else 4 * self.config.n_embd

    # ------------------------------------------------------------------ scaling
    def _rescale_attention_(self, attn: nn.Module, target: float) -> None:
        """Makes `attn` use ``scaling = target`` without changing its function, by rescaling its query rows."""
        factor = float(attn.scaling) / target
        if factor != 1.0:
            with onloaded(attn):
                q_width = PackedConv1DView(attn, "c_attn", 0).part_sizes()[0]
                weight, bias = _scaled_query(attn.c_attn.weight.data, attn.c_attn.bias.data, q_width, factor, True)
                attn.c_attn = _new_conv1d(weight.T, bias, attn.c_attn)
        attn.scaling = target

    # ---------------------------------------------------------------- mutating
    def _concat_query(self, member: BlockView, first: BlockView) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The member's query map rescaled to the scaling of `first`, whose place the concatenation takes (a no-op
        unless ``scale_attn_by_inverse_layer_idx``)."""
        factor = float(member.module.attn.scaling) / float(first.module.attn.scaling)
        q = member.attention.q
        return _scaled_query(q.weight, q.bias, q.out_features, factor, False)

    def reindex_(self, stack: str | None = None) -> None:
        """Renumbers ``attn.layer_idx`` (the KV cache index) and keeps each block's function at its new index.

        With ``scale_attn_by_inverse_layer_idx`` a block's ``scaling`` depends on its index; each block's queries are
        rescaled so that it computes what it computed before with the scaling a fresh block at its new position has
        (exact up to one float rounding of the query weights; see the module docstring).
        """
        super().reindex_(stack)
        for i, layer in enumerate(self.layers(stack)):
            attn = layer.attn
            self._rescale_attention_(attn, expected_scaling(self.config, attn.head_dim, i))

    # -------------------------------------------------------------- merging
    def mergeable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The block's attention and MLP parameters, with the queries expressed at the layer-0 scaling.

        Layers at different indices scale their scores differently under ``scale_attn_by_inverse_layer_idx``; a
        parameter merge must combine the query maps they really apply, so every state uses one reference scaling
        and `build_merged_block` converts back to the scaling of the block's position. Without the option the
        factor is 1 and the state is the block's own.
        """
        state = super().mergeable_state(module)
        attn = module.attn
        factor = float(attn.scaling) / expected_scaling(self.config, attn.head_dim, 0)
        if factor != 1.0 and _QKV_WEIGHT in state:
            q_width = state[_QKV_WEIGHT].shape[1] // 3
            state[_QKV_WEIGHT], state[_QKV_BIAS] = _scaled_query(
                state[_QKV_WEIGHT], state[_QKV_BIAS], q_width, factor, True
            )
        return state

    def build_merged_block(self, stack: str, first: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """A copy of block `first` carrying the merged parameters, its queries brought back to its own scaling."""
        attn = self.layers(stack)[first].attn
        factor = expected_scaling(self.config, attn.head_dim, 0) / float(attn.scaling)
        if factor != 1.0 and _QKV_WEIGHT in state:
            state = dict(state)
            q_width = state[_QKV_WEIGHT].shape[1] // 3
            state[_QKV_WEIGHT], state[_QKV_BIAS] = _scaled_query(
                state[_QKV_WEIGHT], state[_QKV_BIAS], q_width, factor, True
            )
        return super().build_merged_block(stack, first, state)

    # -------------------------------------------------------------- validating
    def block_problems(self, stack: str, index: int, module: nn.Module) -> list[str]:
        """The generic checks, plus Conv1D's informational ``nx``/``nf`` and the index-dependent attention scaling a
        reloaded checkpoint would rebuild."""
        problems = super().block_problems(stack, index, module)
        attn = module.attn
        if getattr(attn.c_attn, PENDING_PART_SIZES, None) is not None:
            return problems
        for name, conv in (("attn.c_attn", attn.c_attn), ("attn.c_proj", attn.c_proj)):
            if (conv.nx, conv.nf) != tuple(conv.weight.shape):
                problems.append(f"layer {index} {name} has nx, nf={conv.nx, conv.nf} for a weight {conv.weight.shape}")
        expected = expected_scaling(self.config, attn.head_dim, index)
        if not abs(float(attn.scaling) - expected) <= 1e-12 * expected:
            problems.append(
                f"layer {index} attention scaling {attn.scaling!r} differs from {expected!r}, what it gets on reload"
            )
        return problems
