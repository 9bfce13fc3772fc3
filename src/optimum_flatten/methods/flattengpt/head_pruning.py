"""FlattenGPT's head step: score the wide block's heads on the o_proj input, keep one layer's KV groups (by
importance, balanced, or by reconstruction) and refit o_proj on them. Apart from the method (`method.py`) because it
is the one step that reads the attention's statistics, and each step's statistics change on their own."""

from __future__ import annotations

from typing import Any

import torch

from ...calibration.cross_moment import CrossMoment
from ...calibration.distributed import all_reduce_, all_reduce_sums, is_sharded
from ...calibration.partial import run_to_input
from ...calibration.stats import SecondMoment
from ...ops import (
    accumulate_head_importance,
    balanced_top_k,
    default_ridge_lambda,
    kv_group_scores,
    nystrom_down_correction,
    o_proj_column_norms,
    top_k_indices,
)
from ...ops.ridge import ridge_refit_to_target
from ...options.methods.flattengpt import FlattenGPTConfig
from ...utils.torch_utils import module_device
from .attention_target import attention_writes_from_states, sequential_attention_writes
from .choices import covariance_dtype, cross_path
from .flatten import WideBlock
from .kv_groups import select_kv_groups_by_reconstruction


def prune_heads(
    config: FlattenGPTConfig,
    group: WideBlock,
    target_kv: int,
    group_outputs: list[torch.Tensor] | None = None,
    states: dict[int, list[torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Keeps `target_kv` whole KV groups of the wide block, by f_i (eq. 12) or by reconstruction, and refits
    o_proj on the kept heads when `attention_correction` asks (Nyström on the o_proj input's second moment).

    Only the attention up to o_proj runs: the head scores and the o_proj moment read its input. With the
    sequential target and `group_outputs` given, the members' run for their writes goes on to their outputs,
    which `group_outputs` receives for the MLP's target. With `states` holding every later member's input, each
    member runs only its attention, on its own input (`attention_writes_from_states`).
    """
    adapter, runner, wide, inputs, context = group.adapter, group.runner, group.wide, group.inputs, group.context
    view = adapter.block_view(wide, group.first)
    geometry = view.attention.geometry
    column_norms = o_proj_column_norms(view.attention.o.weight, geometry.num_heads)
    head_sum = torch.zeros(geometry.num_heads, dtype=torch.float64)
    head_count = 0
    needs_o_moment = config.attention_correction or config.head_selection == "reconstruction"
    device = module_device(wide)  # statistics and solves stay on the device the layer lives on
    heads_width = geometry.num_heads * geometry.head_dim
    precision = covariance_dtype(config, view.attention.o.weight, device, heads_width)
    tf32, split = precision == "tf32", precision == "bfloat16"
    o_moment = SecondMoment(heads_width, device, tf32, split_bfloat16=split) if needs_o_moment else None
    sequential = config.attention_target == "sequential"
    o_module = view.attention.o.module
    writes: list[torch.Tensor] = []
    heads_width, hidden = geometry.num_heads * geometry.head_dim, view.attention.o.weight.shape[0]
    # One rule for the run and the memory model (`choices.cross_path`).
    centred = cross_path(precision, str(view.attention.o.weight.dtype)) == "centred"
    cross = (
        CrossMoment(heads_width, hidden, device, split_bfloat16=split, centred_float32=centred) if sequential else None
    )
    bias = None if getattr(o_module, "bias", None) is None else o_module.bias.detach().float()

    def on_heads(b: int, x: torch.Tensor) -> None:
        nonlocal head_sum, head_count
        mask = runner.masks[b]
        total, count = accumulate_head_importance(x, column_norms, mask)
        head_sum += total.cpu()
        head_count += count
        if o_moment is not None:
            o_moment.update(x, mask)
        if cross is not None:  # the target less the bias o_proj keeps as it is
            target = writes[b].to(x.device)
            cross.update(x, target if bias is None else target - bias.to(x.device), mask)
            writes[b] = None  # type: ignore[call-overload]

    after_o = [o_module, view.mlp_norm.module, view.mlp.module]
    with context.timer("head_scoring"):
        if sequential and states:
            later = [states.pop(i) for i in group.indices[1:]]  # read here only
            writes = attention_writes_from_states(adapter, runner, context.stack, group.indices, [inputs, *later])
            del later
        elif sequential:
            writes = sequential_attention_writes(adapter, runner, context.stack, group.indices, inputs, group_outputs)
        run_to_input(runner, wide, group.first, inputs, o_module, on_heads, after_o)
    if is_sharded():  # the head sums of every rank's share, before they are used
        all_reduce_(head_sum)
        (count,) = all_reduce_sums(head_count)
        head_count = int(count)
    head_scores = head_sum / max(head_count, 1)
    group_scores = kv_group_scores(head_scores, geometry.num_kv_heads)
    o_weight = None
    if config.head_selection == "balanced":
        kept_kv = balanced_top_k(group_scores, target_kv, geometry.num_kv_heads // target_kv)
    elif config.head_selection == "importance":
        kept_kv = top_k_indices(group_scores, target_kv)
    # "reconstruction" chooses below, from the o_proj moment it implies.
    if o_moment is not None:
        with context.timer("attention_solve"):
            o_second_moment = o_moment.finish()
            o_ratio = config.attention_ridge_ratio or config.ridge_ratio
            o_lam = default_ridge_lambda(o_second_moment, o_ratio)
            o_rows = view.attention.o.weight.T
            target = cross.finish() if cross is not None else None
            if config.head_selection == "reconstruction":
                kept_kv = select_kv_groups_by_reconstruction(
                    o_second_moment, o_rows, geometry, target_kv, o_lam, target
                )
            if config.attention_correction:
                channels = torch.tensor(geometry.head_channels(geometry.query_heads_of(kept_kv)))
                if target is None:
                    o_weight = nystrom_down_correction(o_second_moment, o_rows, channels, o_lam).T
                else:
                    o_weight = ridge_refit_to_target(o_second_moment, target[0], o_rows, channels, o_lam).T
            del o_second_moment, o_rows, o_moment, target  # freed before the (larger) MLP statistics
    adapter.keep_heads_(view, kept_kv, o_weight)
    return {
        "num_kv_groups": geometry.num_kv_heads,
        "kv_group_scores": [round(float(s), 6) for s in group_scores],
        "kept_kv_groups": kept_kv,
    }
