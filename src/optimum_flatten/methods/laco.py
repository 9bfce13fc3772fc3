"""LaCo (Yang et al., 2024, "LaCo: Large Language Model Pruning via Layer Collapse").

From the top of a protected range [min_layer, max_layer] downwards, a window of `window_size` consecutive layers
is collapsed into its first by parameter differences, θ* = θ_l + Σ_k (θ_{l+k} − θ_l), computed in float32 from
the unmodified parameters. The collapse is kept when the cosine similarity between the final hidden states of
the collapsed and the original model on the calibration text stays above `threshold`; the window then moves
down by `interval`, otherwise by one layer. It stops when the requested number of layers is removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import MethodConfig
from .registry import register_method
from .stack_search import (
    Group,
    ParameterMergeMethod,
    StackEvaluator,
    check_merge_options,
    identity_stack,
    merge_positions,
)


@dataclass
class LaCoConfig(MethodConfig):
    """Options of LaCo.

    Attributes:
        window_size: Layers collapsed per merge (C in the paper); each accepted merge removes window_size - 1.
        interval: How far the window moves down after an accepted merge (I in the paper).
        threshold: Minimum cosine similarity to the original final hidden states (T); None searches the highest
            threshold that reaches the target.
        min_layer, max_layer: 0-based inclusive range where merges may happen (None: the last layer).
        merge_rule: ``"differences"`` (the paper's formula) or ``"reference_code"`` (the published code's
            in-place update, which ends up copying the last layer's attention and MLP onto the first layer's norms).
        scoring_batches: Compare with the original model on the first this-many calibration batches only (None:
            all); the search runs many candidates, each through every layer above its window.
        search_steps: Bisection steps when `threshold` is None.
    """

    window_size: int = 4
    interval: int = 2
    threshold: float | None = 0.65
    min_layer: int = 1
    max_layer: int | None = None
    merge_rule: Literal["differences", "reference_code"] = "differences"
    search_steps: int = 10
    scoring_batches: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.window_size, int) or self.window_size < 2:
            raise ValueError(f"window_size must be an integer >= 2, got {self.window_size!r}.")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {self.interval!r}.")
        check_merge_options(self.threshold, self.merge_rule, self.search_steps, self.scoring_batches)


@register_method("laco")
class LaCoMethod(ParameterMergeMethod):
    config_class = LaCoConfig
    requires_calibration = True
    config: LaCoConfig

    def search(self, evaluator: StackEvaluator, threshold: float, target: int, top: int) -> list[Group] | None:
        stack = identity_stack(evaluator.num_layers)
        removed = 0
        top_position = top  # the top of the range, in current positions (collapses above `start` shift it down)
        start = top_position - self.config.window_size + 1
        while removed < target and start >= self.config.min_layer:
            # The window never reaches past the range, nor removes more layers than are still wanted.
            size = min(self.config.window_size, target - removed + 1, top_position - start + 1)
            if size < 2:
                start -= 1
                continue
            candidate = merge_positions(stack, start, start + size - 1)
            if evaluator.score(candidate) > threshold:
                stack, removed, top_position = candidate, removed + size - 1, top_position - (size - 1)
                start -= self.config.interval
            else:
                start -= 1
        return stack if removed == target else None
