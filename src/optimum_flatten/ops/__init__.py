"""How, as pure tensor functions: no module access, inputs never mutated, new tensors returned."""

from .head_importance import accumulate_head_importance, kv_group_scores, o_proj_column_norms
from .linear_collapse import (
    BatchNormStats,
    collapse_error,
    collapse_error_bound,
    collapse_linear_pair,
    fold_batchnorm_into_linear,
)
from .merge import MERGE_RULES, merge_as_reference_code, merge_by_differences
from .norm_fold import fold_norm_into_linear
from .ridge import default_ridge_lambda, nystrom_down_correction, ridge_leverage_scores, ridge_reconstruction_error
from .selection import balanced_top_k, greedy_adjacent_groups, top_k_indices

__all__ = [
    "MERGE_RULES",
    "BatchNormStats",
    "accumulate_head_importance",
    "balanced_top_k",
    "collapse_error",
    "collapse_error_bound",
    "collapse_linear_pair",
    "default_ridge_lambda",
    "fold_batchnorm_into_linear",
    "fold_norm_into_linear",
    "greedy_adjacent_groups",
    "kv_group_scores",
    "merge_as_reference_code",
    "merge_by_differences",
    "nystrom_down_correction",
    "o_proj_column_norms",
    "ridge_leverage_scores",
    "ridge_reconstruction_error",
    "top_k_indices",
]
