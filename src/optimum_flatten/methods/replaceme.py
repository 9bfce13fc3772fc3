"""ReplaceMe (Shopkhoev et al., NeurIPS 2025, arXiv 2505.02819): a removed block becomes one linear map.

Selection is UIDL's (the contiguous block with the smallest angular distance between its input and output; their
repository measures the last token), restricted to blocks that have a layer before them, because the map T is folded
into that layer's down projection. T maps that layer's MLP output M so that ``M T + Y`` approximates the block's
output L (Y: that layer's residual stream before its MLP): least squares in closed form, or the cosine distance by
Adam. See docs/methods/replaceme.md and `ops/linear_map.py` for the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import LayerPlan
from .base import CompressionMethod, MethodContext, apply_layer_drop_
from .linear_bridge import BridgeOptions, bridged_apply_, require_pre_norm
from .registry import register_method
from .uidl import BlockSelectionConfig, select_blocks


@dataclass
class ReplaceMeConfig(BlockSelectionConfig):
    """Options of ReplaceMe (besides the block selection's `tokens` and `num_blocks`).

    Attributes:
        estimator: ``"lstsq"`` (closed form, float64 statistics) or ``"cosine"`` (the paper's cosine objective).
        cosine_epochs, cosine_lr, cosine_minibatch: The cosine fit's bounded Adam run (epochs over all tokens).
        seed: Seeds the cosine fit's token order.
    """

    estimator: str = "lstsq"
    cosine_epochs: int = 10
    cosine_lr: float = 1e-4
    cosine_minibatch: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.bridge_options()  # BridgeOptions checks the estimator and the cosine fit's bounds

    def bridge_options(self) -> BridgeOptions:
        return BridgeOptions(self.estimator, self.cosine_epochs, self.cosine_lr, self.cosine_minibatch)


@register_method("replaceme")
class ReplaceMeMethod(CompressionMethod):
    config_class = ReplaceMeConfig
    required_capabilities = frozenset({"layer_drop"})
    #: ReplaceMe is a linear replacement already; a second one on top would refit the same spans.
    accepts_linear_replacement = False
    config: ReplaceMeConfig

    def preflight(self, adapter: Any, stack: str) -> None:
        require_pre_norm(adapter, stack, "method 'replaceme'")

    def plan(self, adapter: Any, context: MethodContext, num_to_remove: int) -> LayerPlan:
        return select_blocks(adapter, context, num_to_remove, self.config, first_start=1)

    def apply_(self, adapter: Any, plan: LayerPlan, context: MethodContext) -> None:
        context.report["replaceme"] = bridged_apply_(
            adapter,
            plan,
            context,
            self.config.bridge_options(),
            lambda: apply_layer_drop_(adapter, plan),
            seed=self.config.seed,
        )
