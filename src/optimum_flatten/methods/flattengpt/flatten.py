"""FlattenGPT's flatten step: fold each member's norm gains into its projections and concatenate the members into
one wide block, which computes them in parallel on one input; `WideBlock` is what the pruning steps then share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import LayerwiseRunner
from ...compression.method import MethodContext
from ...ops import fold_norm_into_linear


@dataclass(frozen=True)
class WideBlock:
    """What the pruning steps of one merged group share: the wide block, the position it takes, the calibration
    inputs it runs on, and the runner and context they run under."""

    adapter: ArchitectureAdapter
    runner: LayerwiseRunner
    wide: nn.Module
    indices: tuple[int, ...]
    inputs: list[torch.Tensor]
    context: MethodContext

    @property
    def first(self) -> int:
        return self.indices[0]


def flatten_group(adapter: ArchitectureAdapter, indices: tuple[int, ...], context: MethodContext) -> nn.Module:
    """The members' norm gains folded into copies of them, concatenated into one wide block (exact: the wide
    block computes the members in parallel on one input)."""
    with context.timer("flatten"):
        members = [adapter.detached_block(context.stack, i) for i in indices]
        for member in members:
            fold_block_norms_(member)
        return adapter.build_concat_block(members)


def fold_block_norms_(block: Any) -> None:
    """Folds a pre-norm block's norm gains (and LayerNorm biases) into q/k/v and gate/up, leaving unit norms.

    Function-preserving: the block computes the same outputs before and after.
    """
    attention_readers = [block.attention.q, block.attention.k, block.attention.v]
    mlp_readers = [block.mlp.up] + ([block.mlp.gate] if block.mlp.gate is not None else [])
    for norm, readers in ((block.attn_norm, attention_readers), (block.mlp_norm, mlp_readers)):
        if norm.is_unit():
            continue
        for linear in readers:
            linear.set_(*fold_norm_into_linear(linear.weight, linear.bias, norm.weight, norm.bias))
        norm.set_unit_()
