"""FlattenGPT's side of a resumed compression (`compression.resume`): a finished group's block rebuilt from its
saved state, and whether the interrupted run measured the groups on the selection's cached inputs."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...compression.method import MethodContext
from ...compression.resume import SavedGroup
from ...options.methods.flattengpt import FlattenGPTConfig


def selection_caches(
    config: FlattenGPTConfig, context: MethodContext, num_layers: int, sequential_calibration: bool
) -> bool:
    """Whether this plan's selection leaves the layer inputs `apply_` measures the groups on (`SelectionCache`):
    the similarity selection in the one-pass mode, with a band that held every layer (its report says)."""
    band = context.report.get("similarity_band") or 0
    return config.selection == "similarity" and not sequential_calibration and band >= num_layers


def rebuild_group(
    flatten: Callable[[ArchitectureAdapter, tuple[int, ...], MethodContext], nn.Module],
    adapter: ArchitectureAdapter,
    saved: SavedGroup,
    context: MethodContext,
) -> nn.Module:
    """A saved group's block: the members flattened and pruned to the saved KV groups and channels, as
    `FlattenGPTMethod.compress_group` built it, then given the saved weights (every weight its solves wrote is in the
    ``state_dict``, so the block is the interrupted run's bit for bit). Rebuilding through the adapter rather
    than unpickling a module keeps the files to plain tensors and works for every family the method takes; the
    cost is one flatten (a copy of the members), no calibration."""
    indices = saved.indices
    wide = flatten(adapter, indices, context)
    adapter.keep_heads_(adapter.block_view(wide, indices[0]), saved.kept_kv_groups)
    adapter.keep_mlp_channels_(adapter.block_view(wide, indices[0]), saved.kept_channels)
    wide.load_state_dict(saved.state, strict=True)
    return wide
