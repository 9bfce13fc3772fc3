"""The compute a compression spent, as its report states it (``cost``): stack passes and the method's own
arithmetic, in units of the calibration that ran; the same vocabulary as the estimates (`compression.compute`),
measured instead of modelled."""

from __future__ import annotations

from typing import Any

import torch

from ..adapters.moe import unrouted_weights
from ..utils import flops
from .method import MethodContext


def compute_cost(
    context: MethodContext,
    stack_weights: int,
    tokens: int,
    dense_forward_flops: float = 0.0,
    work_before: int = 0,
    processes: int = 1,
) -> dict[str, Any]:
    """The compute a method spent, in two machine-free parts.

    ``stack_passes``: weight x token products of every block run (and LM-head evaluations), as a multiple of one pass
    of the calibration tokens through the original stack. ``arithmetic``: the method's own floating-point work
    between those runs (second and cross moments, solves, factorisations; `utils.flops`), per timed phase, by kind
    and precision, and in units of one dense forward of the original stack over the same tokens
    (``dense_forward_flops``, attention's token-pair products included), with its total under ``total``: the phases
    nest as the timings do, so the total is the sum over the outermost phases, ``plan`` and ``apply``.
    Neither depends on the machine or on what else ran; `optimum-flatten estimate --device` turns them into seconds.
    `work_before`: the work earlier attempts of a resumed compression kept (`ResumeState.before`).

    Under a calibration shared by `processes` ranks, `tokens` and `dense_forward_flops` are this rank's share, and
    so is the work: each rank ran its batches and solved the same systems, so the ratios are one rank's cost (what
    sets the wall time), and the unit says so rather than read as the whole calibration's.
    """
    if not tokens or not stack_weights:
        return {"stack_passes": 0.0, "unit": "no calibration"}
    cost: dict[str, Any] = {
        "stack_passes": round((context.work + work_before) / (stack_weights * tokens), 3),
        "unit": f"one pass of {tokens} calibration tokens through the original stack ({stack_weights} weights)",
    }
    if processes > 1:
        cost["unit"] += f", this rank's share of the calibration ({processes} processes, each on its own batches)"
        cost["per_rank"] = True
    if dense_forward_flops:
        over = "this rank's calibration tokens" if processes > 1 else "the calibration tokens"
        count = context.arithmetic
        total = sum(count.flops(p) for p in ("plan", "apply", "export_prep"))
        cost["arithmetic"] = {
            "dense_forwards": round(total / dense_forward_flops, 4),
            "flops": total,
            "host_reads": sum(count.host_reads(p) for p in ("plan", "apply", "export_prep")),
            "launches": sum(count.launches(p) for p in ("plan", "apply", "export_prep")),
            "dense_forward_flops": dense_forward_flops,
            "unit": f"one dense forward of the original stack over {over} (2 x weights x tokens + attention's "
            "token-pair products)",
            "phases": count.to_dict(dense_forward_flops),
        }
    return cost


def dense_forward_flops_of(adapter: Any, stack: str, stack_weights: int, masks: list[torch.Tensor]) -> float:
    """One forward of the original stack over the calibration batches (`utils.flops.dense_forward_flops`); without
    a head geometry (no attention the adapter can describe) only the weight products count.

    `stack_weights` are every weight of the stack; a token is multiplied only by its routed experts in a mixture
    of experts (plus the router and any shared expert), so the experts it is not routed to are taken off, layer by
    layer (`adapters.moe.unrouted_weights`: a stack may mix dense and sparse layers)."""
    try:
        geometry = adapter.block(stack, 0).attention.geometry
        width = geometry.num_heads * geometry.head_dim
    except (AttributeError, NotImplementedError, ValueError):
        width = 0
    num_layers = adapter.num_layers(stack)
    active = stack_weights - sum(unrouted_weights(layer) for layer in adapter.layers(stack))
    return sum(flops.dense_forward_flops(active, int(m.numel()), int(m.shape[-1]), num_layers, width) for m in masks)
