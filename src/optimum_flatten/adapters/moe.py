"""Mixtures of experts: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

Module layout bound here (transformers 5.x, checked on 5.24): the LLaMA attention and norms; ``mlp`` is a sparse
block with a router ``gate`` and ``experts`` holding every expert's maps as 3-d parameters (``gate_up_proj``
(experts, 2 x width, hidden), ``down_proj`` (experts, hidden, width)); Qwen2-MoE adds ``shared_expert`` (a LLaMA
MLP) scaled by ``sigmoid(shared_expert_gate(x))``. Which layers are sparse is per-layer config
(``mlp_only_layers``, ``decoder_sparse_step``), rewritten by `adapters.per_layer`.

There is no single MLP to view, so only what works on whole blocks applies: layer drops, and compensation (the
router reads the normalised stream, and every expert's and the shared expert's down projection scales exactly).
Merges are refused (`missing_capability_reasons`).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

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
    "down_fold": "a map folded into the down projection would have to go into every expert, which is not implemented",
}


class MoeAdapter(ArchitectureAdapter):
    """Pre-norm decoders whose MLP is a sparse mixture of experts: layer drops and compensation."""

    capabilities = frozenset({"head_geometry", "pre_norm", "layer_drop", "stream_scale"})
    missing_capability_reasons: ClassVar[dict[str, str]] = MOE_REASONS
    layouts = (MOE_LAYOUT,)

    def _size_attributes(self, module: nn.Module) -> list[tuple[nn.Module, str, int]]:
        return []  # neither the attention nor the experts keep sizes beside their weights; nothing is resized

    def _mlp_width_problem(self, block: BlockView, width: int, width_name: str) -> str | None:
        return None  # the experts are never resized, and dense layers (mlp_only_layers) have another width

    def scale_stream_writes_(self, module: nn.Module, index: int, factor: float) -> None:
        """o_proj, every expert's down projection and the shared expert's (the gate of the shared expert reads the
        normalised stream, so it is unchanged)."""
        o = self.block_view(module, index).attention.o
        o.set_(o.weight * factor, None if o.bias is None else o.bias * factor)
        mlp = module.mlp
        experts = getattr(mlp, "experts", None)
        targets = [experts.down_proj] if experts is not None else []
        for name in ("shared_expert", "down_proj"):  # shared expert (Qwen2-MoE); a dense layer's own down_proj
            part = getattr(mlp, name, None)
            if isinstance(part, nn.Module) and hasattr(part, "down_proj"):
                part = part.down_proj
            if isinstance(part, nn.Linear):
                targets += [part.weight] + ([part.bias] if part.bias is not None else [])
        for parameter in targets:
            parameter.data.mul_(factor)


@register_adapter
class MixtralAdapter(MoeAdapter):
    model_types = ("mixtral",)


@register_adapter
class QwenMoeAdapter(MoeAdapter):
    """Qwen2-MoE and Qwen3-MoE (Qwen3-MoE's q_norm/k_norm would rule out head concatenation too)."""

    model_types = ("qwen2_moe", "qwen3_moe")
