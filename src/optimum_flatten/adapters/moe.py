"""Mixtures of experts: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

Module layout bound here (transformers 5.x, checked on 5.24): the LLaMA attention and norms; ``mlp`` is a sparse
block with a router ``gate`` and ``experts`` holding every expert's maps as 3-d parameters (``gate_up_proj``
(experts, 2 x width, hidden), ``down_proj`` (experts, hidden, width)); Qwen2-MoE adds ``shared_expert`` (a LLaMA
MLP) scaled by ``sigmoid(shared_expert_gate(x))``. Which layers are sparse is per-layer config
(``mlp_only_layers``, ``decoder_sparse_step``), rewritten by `adapters.per_layer`.

There is no single MLP to view, so what applies is what acts on a block's whole MLP output: layer drops,
compensation (the router reads the normalised stream, and every expert's and the shared expert's down projection
scales exactly) and a map folded after the MLP (ReplaceMe's bridge, `linear_replacement`): the MLP output is
``Σ_e g_e(x) W_e a_e(x) + σ(s(x)) W_s a_s(x)`` with the routing weights g_e and the shared gate σ(s(x)) read from the
normalised stream before the map, so ``(…) T`` equals the same sum with every ``W_e`` and ``W_s`` replaced by
``Tᵀ W``: exact, whichever experts a token is routed to. Merges and the down refit (``"lstsq_down"``: there is no
one down projection whose inputs could be fitted) are refused (`missing_capability_reasons`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..ops.linear_map import fold_map_into_linear
from .base import ArchitectureAdapter
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .registry import register_adapter
from .views import BlockView

MOE_LAYOUT = BlockLayout(
    attention=AttentionLayout(kv_heads_key="num_key_value_heads"),
    # No up/gate/down or activation of its own (dense layers among sparse ones have them): the views are never read.
    mlp=MlpLayout(activation=""),
)

MOE_REASONS: dict[str, str] = {
    "concat_heads": "a mixture-of-experts block has a router and experts, not MLP channels that can be "
    "concatenated across layers",
    "dense_mlp": "the MLP is a router over experts, not one dense MLP",
    "parameter_merge": "expert e of one layer has no relation to expert e of another (experts are interchangeable "
    "within a layer), so parameter differences between layers are not defined",
}


class MoeAdapter(ArchitectureAdapter):
    """Pre-norm decoders whose MLP is a sparse mixture of experts: layer drops, compensation and bridges."""

    capabilities = frozenset({"head_geometry", "pre_norm", "layer_drop", "stream_scale", "down_fold"})
    missing_capability_reasons: ClassVar[dict[str, str]] = MOE_REASONS
    layouts = (MOE_LAYOUT,)

    def _size_attributes(self, module: nn.Module) -> list[tuple[nn.Module, str, int]]:
        return []  # neither the attention nor the experts keep sizes beside their weights; nothing is resized

    def _mlp_width_problem(self, block: BlockView, width: int, width_name: str) -> str | None:
        return None  # the experts are never resized, and dense layers (mlp_only_layers) have another width

    def mlp_active_width(self, module: nn.Module, index: int) -> int:
        experts, linears = _mlp_writers(module.mlp)
        routed = experts[0].shape[2] * module.mlp.gate.top_k if experts else 0
        return routed + sum(linear.in_features for linear in linears)

    def mlp_writers(self, module: nn.Module, index: int) -> list[nn.Parameter]:
        """Every expert's down projection (one 3-d parameter, experts × hidden × width), the shared expert's
        (Qwen2-MoE) and, in a dense layer among sparse ones (``mlp_only_layers``), the layer's own."""
        experts, linears = _mlp_writers(module.mlp)
        return experts + [p for linear in linears for p in linear.parameters()]

    def fold_after_mlp_(self, module: nn.Module, index: int, transform: torch.Tensor) -> None:
        """``W' = Tᵀ W`` for every expert and down projection of `mlp_writers` (``b' = b T``), in float64."""
        experts, linears = _mlp_writers(module.mlp)
        for parameter in experts:
            t = transform.to(parameter.device)
            folded = torch.stack([fold_map_into_linear(w, None, t)[0] for w in parameter.data])
            parameter.data = folded.to(parameter.dtype)
        for linear in linears:
            weight, bias = fold_map_into_linear(linear.weight, linear.bias, transform.to(linear.weight.device))
            linear.weight.data = weight.to(linear.weight.dtype)
            if bias is not None:
                linear.bias.data = bias.to(linear.bias.dtype)

    def scale_stream_writes_(self, module: nn.Module, index: int, factor: float) -> None:
        """o_proj and every writer of the MLP output (`mlp_writers`); the gate of the shared expert reads the
        normalised stream, so it is unchanged."""
        o = self.block_view(module, index).attention.o
        o.set_(o.weight * factor, None if o.bias is None else o.bias * factor)
        for parameter in self.mlp_writers(module, index):
            parameter.data.mul_(factor)


def _mlp_writers(mlp: nn.Module) -> tuple[list[nn.Parameter], list[nn.Linear]]:
    """The experts' 3-d down projections and the plain down projections (shared expert, a dense layer's own)."""
    experts = getattr(mlp, "experts", None)
    linears = []
    for name in ("shared_expert", "down_proj"):
        part = getattr(mlp, name, None)
        if isinstance(part, nn.Module) and hasattr(part, "down_proj"):
            part = part.down_proj
        if isinstance(part, nn.Linear):
            linears.append(part)
    return ([experts.down_proj] if experts is not None else []), linears


@dataclass(frozen=True)
class MoeShape:
    """What one token runs of a sparse MLP, for the estimates: the arithmetic (a token is multiplied by its `top_k`
    routed experts, not by all `num_experts` held in memory) and the routing temporaries (`compression.workspace`).

    Attributes:
        num_experts, top_k: experts held, experts a token is routed to.
        expert_width: one expert's MLP width (``moe_intermediate_size``; Mixtral's ``intermediate_size``).
        expert_weights: parameters of every expert together (3-d ``gate_up_proj`` and ``down_proj``).
        shared_width: the width of the shared expert every token also runs (Qwen2-MoE), 0 without one.
    """

    num_experts: int
    top_k: int
    expert_width: int
    expert_weights: int
    shared_width: int = 0

    @property
    def unrouted_weights(self) -> int:
        """Parameters of the experts a token is not routed to: held, never multiplied by that token."""
        return self.expert_weights // self.num_experts * (self.num_experts - self.top_k)


def moe_shape(mlp: nn.Module) -> MoeShape | None:
    """The `MoeShape` of a sparse MLP block (a router ``gate`` with ``top_k`` and ``experts`` holding 3-d
    parameters, the layout of the module docstring), None for any other module (a dense MLP among sparse ones)."""
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(down, nn.Parameter) or down.dim() != 3 or not hasattr(gate, "top_k"):
        return None
    shared = getattr(mlp, "shared_expert", None)
    return MoeShape(
        num_experts=int(down.shape[0]),
        top_k=int(gate.top_k),
        expert_width=int(down.shape[2]),
        expert_weights=sum(p.numel() for p in experts.parameters()),
        shared_width=int(shared.down_proj.in_features) if isinstance(shared, nn.Module) else 0,
    )


def unrouted_weights(layer: nn.Module) -> int:
    """Parameters of `layer` (a decoder layer, or any module) that one token is not multiplied by: the experts it is
    not routed to, in each sparse MLP block inside it (0 for a dense layer). A forward's flops are 2 x (parameters
    less these) per token: counting every expert made Mixtral's MLP flops 4x what it computes (8 experts, top-2)."""
    shapes = (moe_shape(module) for module in layer.modules())
    return sum(shape.unrouted_weights for shape in shapes if shape is not None)


@register_adapter
class MixtralAdapter(MoeAdapter):
    model_types = ("mixtral",)


@register_adapter
class QwenMoeAdapter(MoeAdapter):
    """Qwen2-MoE and Qwen3-MoE (Qwen3-MoE's q_norm/k_norm would rule out head concatenation too)."""

    model_types = ("qwen2_moe", "qwen3_moe")
