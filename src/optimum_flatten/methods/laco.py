"""LaCo (Yang et al., 2024, "LaCo: Large Language Model Pruning via Layer Collapse").

From the top of a protected range [min_layer, max_layer] downwards, a window of `window_size` consecutive layers
is collapsed into its first by parameter differences, θ* = θ_l + Σ_k (θ_{l+k} − θ_l), computed in float32 from
the unmodified parameters. The collapse is kept when the cosine similarity between the final hidden states of
the collapsed and the original model on the calibration text stays above `threshold`; the window then moves
down by `interval`, otherwise by one layer. It stops when the requested number of layers is removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import register_method
from .stack_search import (
    Group,
    MergeSearchConfig,
    ParameterMergeMethod,
    StackEvaluator,
    identity_stack,
    merge_positions,
)


@dataclass
class LaCoConfig(MergeSearchConfig):
    """Options of LaCo (the shared ones are documented on MergeSearchConfig).

    Attributes:
        window_size: Layers collapsed per merge (C in the paper); each accepted merge removes window_size - 1.
        interval: How far the window moves down after an accepted merge (I in the paper).
        threshold: Minimum cosine similarity to the original final hidden states (T in the paper, 0.65 there).
    """

    threshold: float | None = 0.65
    window_size: int = 4
    interval: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.window_size, int) or self.window_size < 2:
            raise ValueError(f"window_size must be an integer >= 2, got {self.window_size!r}.")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {self.interval!r}.")


@register_method("laco")
class LaCoMethod(ParameterMergeMethod):
    config_class = LaCoConfig
    requires_calibration = True
    config: LaCoConfig

    def accepts(self, score: float, threshold: float) -> bool:
        """The paper keeps a collapse when the similarity exceeds the threshold (strictly)."""
        return score > threshold

    def shortfall_hints(self) -> list[str]:
        return [f"window_size (now {self.config.window_size}: a smaller window changes the model less per merge)"]

    def search(self, evaluator: StackEvaluator, threshold: float, target: int, top: int) -> list[Group]:
        stack = identity_stack(evaluator.num_layers)
        removed = 0
        top_position = top  # the top of the range, in current positions (collapses above `start` shift it down)
        # A range shorter than the window still gets the largest window that fits, rather than no search at all.
        start = max(self.config.min_layer, top_position - self.config.window_size + 1)
        while removed < target and start >= self.config.min_layer:
            # The window never reaches past the range, nor removes more layers than are still wanted.
            size = min(self.config.window_size, target - removed + 1, top_position - start + 1)
            if size < 2:
                start -= 1
                continue
            candidate = merge_positions(stack, start, start + size - 1)
            if self.accepts(evaluator.score(candidate), threshold):
                stack, removed, top_position = candidate, removed + size - 1, top_position - (size - 1)
                start -= self.config.interval
            else:
                start -= 1
        return stack
