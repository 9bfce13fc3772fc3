"""Sliding-Window Merging (AAAI-26): grow a window of adjacent layers from the top, merge it, slide down.

Within a protected range [min_layer, max_layer] a window ending at layer e grows towards shallower layers while
the model with the window merged by parameter differences (θ* = θ_s + Σ_k (θ_k − θ_s), float32, unmodified
parameters) stays similar to the original (cosine or linear CKA of the final hidden states, on the calibration
text) above `threshold`. The largest accepted window is merged and the next window ends just below it. With a
target number of removed layers, merging stops when it is reached, and `threshold=None` searches the highest
threshold that reaches it.

The published code never commits the window it is growing when the loop reaches the bottom of the range; that
behaviour, and its in-place merge (which copies the last layer onto the first layer's norms), are reproduced
only with ``merge_rule="reference_code"``.
"""

from __future__ import annotations

from ..options.methods.sliding_window import SlidingWindowConfig
from ..registry import register_method
from .laco import (
    Group,
    ParameterMergeMethod,
    StackEvaluator,
    identity_stack,
    merge_positions,
)


@register_method("sliding_window")
class SlidingWindowMethod(ParameterMergeMethod):
    config_class = SlidingWindowConfig
    requires_calibration = True
    config: SlidingWindowConfig

    def search(self, evaluator: StackEvaluator, threshold: float, target: int, top: int) -> list[Group]:
        stack: list[Group] = identity_stack(evaluator.num_layers)
        removed = 0
        end = top
        reference_code = self.config.merge_rule == "reference_code"
        while removed < target and end > self.config.min_layer:
            # Below `end` nothing is merged yet, so positions there are original indices.
            start, best, reached_bottom = end - 1, None, False
            while True:
                if start < self.config.min_layer:
                    reached_bottom = True
                    break
                if end - start > target - removed or not evaluator.one_kind(stack, start, end):
                    break
                score = evaluator.score(merge_positions(stack, start, end), self.config.similarity)
                if not self.accepts(score, threshold):
                    break
                best, start = start, start - 1
            if best is not None and not (reference_code and reached_bottom):
                stack = merge_positions(stack, best, end)
                removed += end - best
                end = best - 1
            else:
                end = end - 1 if best is None else best - 1
        return stack
