"""The options LaCo and sliding-window merging share: a torch-free declaration (methods/laco/search.py searches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..hints import MethodConfig, check_scoring_batches

#: The merge rules' names (`ops.merge.MERGE_RULES` holds the functions; a test checks the two agree).
MERGE_RULE_NAMES = ("differences", "reference_code")


def check_merge_options(
    threshold: float | None, merge_rule: str, search_steps: int, scoring_batches: int | None = None
) -> None:
    """Validation shared by the parameter-merge methods' configs."""
    check_scoring_batches(scoring_batches)
    if not isinstance(search_steps, int) or search_steps < 1:
        raise ValueError(f"search_steps must be a positive integer, got {search_steps!r}.")
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < float(threshold) <= 1.0):
        raise ValueError(f"threshold must be in (0, 1] or None (search it), got {threshold!r}.")
    if merge_rule not in MERGE_RULE_NAMES:
        raise ValueError(f"merge_rule must be one of {sorted(MERGE_RULE_NAMES)}, got {merge_rule!r}.")


@dataclass
class MergeSearchConfig(MethodConfig):
    """Options shared by the methods that search merged stacks above a similarity threshold.

    Attributes:
        threshold: Minimum similarity to the original model's final states; None searches the highest threshold
            that reaches the target.
        min_layer, max_layer: 0-based inclusive range where merges may happen (None: the last layer).
        merge_rule: ``"differences"`` (the papers' θ* = θ_l + Σ_k (θ_k − θ_l)) or ``"reference_code"`` (the
            published code's in-place update, which ends up copying the last layer's attention and MLP onto the first
            layer's norms).
        search_steps: Bisection steps when `threshold` is None.
        scoring_batches: Compare with the original model on the first this-many calibration batches only (None:
            all); the search runs many candidates, each through every layer above its window.
    """

    threshold: float | None = None
    min_layer: int = 1
    max_layer: int | None = None
    merge_rule: Literal["differences", "reference_code"] = "differences"
    search_steps: int = 10
    scoring_batches: int | None = None

    def __post_init__(self) -> None:
        check_merge_options(self.threshold, self.merge_rule, self.search_steps, self.scoring_batches)
