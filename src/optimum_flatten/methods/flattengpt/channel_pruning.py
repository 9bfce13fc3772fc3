"""FlattenGPT's MLP step: the wide block's down-input second moment (and with the sequential target its cross
moment with the group's output), then the channels kept by ridge leverage and the down projection refitted on them.
Apart from the method (`method.py`) because it holds the largest statistic and its two solve paths (float64, and
float32 with a float64 solve on the kept block), whose memory `workspace.py` follows phase by phase."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...calibration.cross_moment import CrossMoment
from ...calibration.partial import run_to_input
from ...calibration.stats import CentredSecondMoment, SecondMoment
from ...ops import (
    default_ridge_lambda,
    nystrom_down_correction,
    ridge_leverage_scores,
    top_k_indices,
)
from ...ops.ridge import (
    kept_block,
    kept_blocks,
    nystrom_from_factor,
    ridge_factor,
    ridge_leverage_scores_packed,
    ridge_refit_to_target,
)
from ...options.methods.flattengpt import FlattenGPTConfig
from ...utils import flops
from ...utils.torch_utils import module_device
from .attention_target import sequential_group_outputs
from .choices import MLP_CROSS_CHUNK, covariance_dtype, cross_path
from .flatten import WideBlock


def prune_channels(
    config: FlattenGPTConfig,
    group: WideBlock,
    target_channels: int,
    group_outputs: list[torch.Tensor] | None = None,
    traced_outputs: list[torch.Tensor] | None = None,
    states: dict[int, list[torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Keeps `target_channels` MLP channels by ridge leverage and refits the down projection on them (Nyström),
    on the activations the pruned attention produces; the down projection, whose input is the statistic, does
    not run. The sequential target reads the original group's outputs: the state entering the next layer when
    `states` holds it, `traced_outputs` when the attention's run of the members already gave them, else the
    members run once more."""
    adapter, runner, wide, inputs, context = group.adapter, group.runner, group.wide, group.inputs, group.context
    view = adapter.block_view(wide, group.first)
    width = view.mlp.intermediate_size
    device = module_device(wide)
    precision = covariance_dtype(config, view.mlp.down.weight, device, width)
    float64 = precision == "float64"
    tf32, split = precision == "tf32", precision == "bfloat16"
    moment = (
        SecondMoment(width, device) if float64 else CentredSecondMoment(width, device, tf32=tf32, split_bfloat16=split)
    )
    sequential = config.mlp_target == "sequential"  # the config refuses it without mlp_correction
    down = view.mlp.down.module
    # Chunks of 1,024 tokens: each takes a float64 copy of the wide activations (0.5 GiB at LLaMA-2-70B's 57,344).
    hidden = view.mlp.down.weight.shape[0]
    centred = cross_path(precision, str(view.mlp.down.weight.dtype)) == "centred"
    cross = (
        CrossMoment(width, hidden, device, MLP_CROSS_CHUNK, split_bfloat16=split, centred_float32=centred)
        if sequential
        else None
    )
    bias = None if getattr(down, "bias", None) is None else down.bias.detach().float()
    outputs: list[torch.Tensor] = []
    residual: list[torch.Tensor] = []  # the MLP norm's input of the batch running (read before its down input)

    def on_mlp_norm(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        residual[:] = [args[0]]

    def on_mlp(b: int, x: torch.Tensor) -> None:
        mask = runner.masks[b]
        moment.update(x, mask)
        if cross is not None:  # what the block must still write, less the bias the projection keeps
            target = outputs[b].to(x.device).float() - residual.pop().to(x.device).float()
            cross.update(x, target if bias is None else target - bias.to(x.device), mask)
            if group_outputs is None:  # else kept for the caller, who propagates them
                outputs[b] = None  # type: ignore[call-overload]

    with context.timer("covariance"):
        if sequential and states:  # `member_states` names the layer after the group with the MLP's target
            outputs = states.pop(group.indices[-1] + 1)
        elif sequential and traced_outputs is not None:
            outputs = traced_outputs
        elif sequential:
            outputs = sequential_group_outputs(adapter, runner, context.stack, group.indices, inputs)
        handle = view.mlp_norm.module.register_forward_pre_hook(on_mlp_norm) if sequential else None
        try:
            run_to_input(runner, wide, group.first, inputs, down, on_mlp, [down])
        finally:
            if handle is not None:
                handle.remove()
        if group_outputs is not None:
            group_outputs.extend(outputs)
    with context.timer("solve"):
        down_rows = view.mlp.down.weight.T
        target = cross.finish()[0] if cross is not None else None
        if float64:
            kept_channels, corrected, lam = _mlp_float64(config, moment, down_rows, target_channels, target)
        else:
            kept_channels, corrected, lam = _mlp_float32(config, moment, down_rows, target_channels, target)
        adapter.keep_mlp_channels_(view, kept_channels, corrected.T)
    # Read after `finish`, which sums a sharded calibration's counts over the ranks.
    return {
        "kept_channels": kept_channels,
        "ridge_lambda": lam,
        "calibration_tokens": moment.count,
        "covariance_dtype": precision,
    }


def _mlp_float64(
    config: FlattenGPTConfig, moment: SecondMoment, down_rows: Tensor, num_keep: int, target: Tensor | None
) -> tuple[list[int], Tensor, float]:
    """Leverage and Nyström (or the ridge refit towards `target`'s cross moment) on a float64 C with a full
    float64 factor (the reference path)."""
    second_moment = moment.finish()
    lam = default_ridge_lambda(second_moment, config.ridge_ratio)
    kept_channels = top_k_indices(ridge_leverage_scores(second_moment, lam), num_keep)
    if not config.mlp_correction:
        return kept_channels, down_rows[torch.tensor(kept_channels, device=down_rows.device)], lam
    keep = torch.tensor(kept_channels)
    if target is not None:
        return kept_channels, ridge_refit_to_target(second_moment, target, down_rows, keep, lam), lam
    corrected = nystrom_down_correction(second_moment, down_rows, keep, lam)
    return kept_channels, corrected, lam


def _mlp_float32(
    config: FlattenGPTConfig, moment: CentredSecondMoment, down_rows: Tensor, num_keep: int, target: Tensor | None
) -> tuple[list[int], Tensor, float]:
    """Leverage from a triangle-only float32 factor (the channels near the cut re-scored in float64, so the
    kept set is the float64 path's); the Nyström solve on the kept block in float64.

    Holds at most the float32 scatter with either the factor's triangle or the float64 kept block and
    C[K, R] W_D[R]; the scatter is dropped before the kept block is factorised, and the block once it is.
    """
    stats = moment.finish()
    lam = config.ridge_ratio * stats.trace() / stats.dim
    leverage = ridge_leverage_scores_packed(
        lambda start, stop: stats.block(slice(start, None), slice(start, stop)),
        stats.dim,
        lam,
        refine_top_k=num_keep,
    )
    kept_channels = top_k_indices(leverage, num_keep)
    keep = torch.tensor(kept_channels, device=down_rows.device)
    if not config.mlp_correction:
        stats.release()
        return kept_channels, down_rows[keep], lam
    if target is None:
        kept, cross = kept_blocks(stats.block, stats.dim, down_rows, keep)
        stats.release()
    else:  # S_K − C_KK W_K in place of Nyström's C_KR W_R (`ridge_refit_to_target`): C[K, R] is not read
        kept = kept_block(stats.block, keep, down_rows.device)
        stats.release()
        flops.record(flops.product(keep.numel(), keep.numel(), down_rows.shape[1]), "float64")
        cross = target[keep.to(target.device)].to(kept.device) - kept @ down_rows[keep].double()
    factor = ridge_factor(kept, lam)
    del kept  # the solve copies the factor once more (column-major): the block would be a third k x k
    corrected = nystrom_from_factor(factor, cross, down_rows[keep])
    return kept_channels, corrected, lam
