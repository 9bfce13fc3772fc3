"""LaCo: collapse windows of adjacent layers into one by parameter differences while the model stays similar.

`method.py` is the registered method (the paper's top-down window walk), `search.py` the search over candidate
merged stacks it runs (a cached-prefix evaluator, the threshold search, the parameter merge and its plan), which
Sliding-Window Merging reuses through the names below. The options are in `optimum_flatten.options.methods.laco`.
"""

from ...options.methods.laco import LaCoConfig
from .method import LaCoMethod
from .search import (
    NLL_RISE_BOUND,
    Group,
    ParameterMergeMethod,
    StackEvaluator,
    identity_stack,
    merge_positions,
)

__all__ = [
    "NLL_RISE_BOUND",
    "Group",
    "LaCoConfig",
    "LaCoMethod",
    "ParameterMergeMethod",
    "StackEvaluator",
    "identity_stack",
    "merge_positions",
]
