"""LaCo (Yang et al., 2024, "LaCo: Large Language Model Pruning via Layer Collapse").

From the top of a protected range [min_layer, max_layer] downwards, a window of `window_size` consecutive layers
is collapsed into its first by parameter differences, θ* = θ_l + Σ_k (θ_{l+k} − θ_l), computed in float32 from
the unmodified parameters. The collapse is kept when the cosine similarity between the final hidden states of
the collapsed and the original model on the calibration text stays above `threshold`; the window then moves
down by `interval`, otherwise by one layer. It stops when the requested number of layers is removed.

Not the paper's when windows chain (a window taking in a layer an earlier one collapsed): the paper collapses the
current model, so that member enters as its collapsed parameters; here every group is merged flat from its members'
original parameters (docs/methods/laco.md, "Known departure from the paper").
"""

from __future__ import annotations

from ...options.methods.laco import LaCoConfig
from ...registry import register_method
from .search import (
    Group,
    ParameterMergeMethod,
    StackEvaluator,
    identity_stack,
    merge_positions,
)


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
            stop = start + size - 1
            candidate = merge_positions(stack, start, stop)
            if evaluator.one_kind(stack, start, stop) and self.accepts(evaluator.score(candidate), threshold):
                stack, removed, top_position = candidate, removed + size - 1, top_position - (size - 1)
                start -= self.config.interval
            else:
                start -= 1
        return stack
