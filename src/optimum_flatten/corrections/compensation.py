"""Magnitude compensation after a layer drop (Prune&Comp, Chen et al., AAAI 2026, arXiv 2507.18212).

Dropping layer l feeds its input x_l to layer l+1, which was trained on x_{l+1}, a stream of a different magnitude.
Prune&Comp rescales everything upstream of the cut by one scalar

    α_l = mean over channels c of E[|x_{l+1,c}|] / E[|x_{l,c}|]        (real tokens only)

measured on the model as already compensated for the earlier drops, and folds α_l into every writer of the residual
stream before l: the token (and learned position) embedding and the output projections (o_proj, down_proj, biases
included) of the kept layers below l. In a pre-norm stack every layer reads the stream through a scale-invariant norm,
so this scales the stream entering l+1 by α_l exactly (up to the norm's ε) and changes nothing else upstream.

Because of that invariance the α's can be measured *before* any weight changes: running an unchanged layer on α·x
gives exactly what the compensated model computes, so the measurement walks the original layers on virtually scaled
states, and the fold happens once, after the plan is applied.

Tied embeddings: the LM head shares the embedding matrix, so scaling it would scale the logits. The final norm's gain
(and bias) is divided by the same factor, so that lm_head(norm(h)) is what it was; the tie is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import edit_block_, is_offloaded


def _stream_sources(adapter: ArchitectureAdapter) -> list[torch.nn.Module]:
    """The embedding tables that write the stream before layer 0 (token, and a learned position table if any)."""
    sources = [adapter.embeddings()]
    position = getattr(adapter, "position_embeddings", None)
    if callable(position):
        sources.append(position())
    return sources


def require_pre_norm(adapter: ArchitectureAdapter, stack: str, why: str, instead: str) -> None:
    """Refuses a stack that is not pre-norm, saying `why` the correction needs one and what to do `instead`.

    Compensation and the linear bridge both fold into the writers of an unnormalised residual stream, so both
    refuse a post-norm stack before any change, in the same words about the stack."""
    position = adapter.block(stack, 0).norm_position
    if position != "pre":
        raise UnsupportedArchitectureError(
            f"{why} (pre-norm); this {type(adapter.model).__name__} stack {stack!r} is {position}-norm. {instead}"
        )


def require_compensable(adapter: ArchitectureAdapter, stack: str) -> None:
    """Refuses, before any change, a stack the fold cannot describe exactly."""
    require_pre_norm(
        adapter,
        stack,
        "compensation='scale' folds a factor into every writer of the residual stream, which leaves the function "
        "unchanged only when each layer reads the stream through a norm",
        "Drop compensation.",
    )
    if missing := adapter.missing_capabilities({"stream_scale"}):
        raise UnsupportedArchitectureError(
            f"compensation='scale' cannot be folded into model_type {adapter.config.model_type!r}: "
            f"{missing['stream_scale']}. Drop compensation."
        )
    if getattr(adapter.config, "vision_config", None) is not None:  # an image-text model: its projector writes too
        raise UnsupportedArchitectureError(
            f"folding a factor into the stream (compensation='scale', or a bridge's stream gain) scales the token "
            f"embeddings, and this {type(adapter.model).__name__} also writes image features into the stream at "
            "image positions, which the fold would leave unscaled (text and images then on different scales); drop "
            "the compensation or the gain, or compress the text-only model."
        )
    for source in _stream_sources(adapter):
        if not isinstance(source, torch.nn.Embedding):
            raise UnsupportedArchitectureError(
                f"compensation='scale' folds into embedding tables, and this {type(adapter.model).__name__} writes "
                f"its stream with a {type(source).__name__} (patches or scaled embeddings); drop compensation."
            )
    _require_sources_in_memory(adapter, stack)


def _require_sources_in_memory(adapter: ArchitectureAdapter, stack: str) -> None:
    """Refuses embeddings (or, tied, the final norm) that accelerate keeps offloaded: the fold writes into their
    weights in place (`fold_stream_scales_`), and an offloaded module's weights are placeholders its hook refills,
    so the factor would be lost from the model and its checkpoint while the layers kept theirs."""
    names = {module: name for name, module in adapter.model.named_modules()}
    modules = list(_stream_sources(adapter))
    head, norm = adapter.lm_head(stack), adapter.final_norm(stack)
    tied = head is not None and any(getattr(head, "weight", None) is source.weight for source in modules)
    if norm is not None and (tied or getattr(adapter.config, "tie_word_embeddings", False)):
        modules.append(norm)
    held = [names.get(module, type(module).__name__) for module in modules if is_offloaded(module)]
    if held:
        raise UnsupportedArchitectureError(
            f"folding a factor into the stream (compensation='scale', or a bridge's stream gain) writes into "
            f"{', '.join(held)}, which this model keeps offloaded (device_map), so the factor would be lost; load "
            "them on a device (device_map placing them on 'cpu' or a GPU), or drop the compensation or the gain."
        )


@torch.no_grad()
def measure_scales(runner: Any, layers: Sequence[torch.nn.Module], plan: LayerPlan) -> dict[int, float]:
    """α of every dropped layer, bottom-up, each on the stream already compensated for the drops below it."""
    if plan.merged_groups:
        raise ValueError(
            f"compensation='scale' is defined for dropped layers (Prune&Comp); this plan merges {plan.merged_groups}. "
            "Use it with shortgpt, sleb or uidl, or use linear_replacement for merging methods."
        )
    dropped = set(plan.dropped_indices)
    current = list(runner.inputs)
    scales: dict[int, float] = {}
    for index, layer in enumerate(layers):
        output = runner.run(layer, index, current)
        if index in dropped:
            alpha = magnitude_ratio(current, output, runner.masks)
            scales[index] = alpha
            current = [h * alpha for h in current]
        else:
            current = output
        if dropped and index >= max(dropped):
            break
    return scales


def magnitude_ratio(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None]
) -> float:
    """mean_c E|after_c| / E|before_c| over real tokens (float64 sums; channels never active are left out)."""
    sum_before = sum_after = None
    for x, y, mask in zip(before, after, masks, strict=True):
        keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.bool().to(x.device)
        a = x[keep].abs().sum(dim=0, dtype=torch.float64)
        b = y[keep.to(y.device)].abs().sum(dim=0, dtype=torch.float64).to(a.device)
        sum_before = a if sum_before is None else sum_before + a
        sum_after = b if sum_after is None else sum_after + b
    if sum_before is None:
        raise ValueError("no calibration batch to measure the compensation on.")
    live = sum_before > 0
    return float((sum_after[live] / sum_before[live]).mean())


@torch.no_grad()
def fold_stream_scales_(
    adapter: ArchitectureAdapter, stack: str, layer_scales: Sequence[float], embedding_scale: float
) -> None:
    """Multiplies the embeddings by `embedding_scale` and layer k's o/down projections by `layer_scales[k]`.

    With tied embeddings the final norm is divided by `embedding_scale`, so the logits stay what they were.
    """
    head = adapter.lm_head(stack)
    tied = False
    for source in _stream_sources(adapter):
        if head is not None and getattr(head, "weight", None) is source.weight:
            tied = True
        source.weight.data.mul_(embedding_scale)
    for k in range(adapter.num_layers(stack)):

        def edit(module: torch.nn.Module, k: int = k) -> None:
            adapter.scale_stream_writes_(module, k, layer_scales[k])

        edit_block_(adapter.layers(stack), k, edit, memo={id(adapter.config): adapter.config})
    if tied:
        norm = adapter.final_norm(stack)
        if norm is None:
            raise UnsupportedArchitectureError(
                "compensation='scale' with tied embeddings needs a final norm to absorb the factor; this model has "
                "none. Drop compensation."
            )
        adapter.scale_norm_(norm, 1.0 / embedding_scale)


def compensated_apply_(
    adapter: ArchitectureAdapter, plan: LayerPlan, context: Any, apply: Any, scales: dict[int, float] | None = None
) -> dict[str, Any]:
    """Measures every α on the original layers (unless the method's own loop gave `scales`, one per dropped layer),
    runs `apply()` (the drop), then folds; returns the report entry."""
    if scales is None:
        runner = context.new_runner(adapter)
        layers = list(adapter.layers(plan.stack))
        with context.timer("compensation"):
            scales = measure_scales(runner, layers, plan)
    elif set(scales) != set(plan.dropped_indices):
        raise RuntimeError(
            f"compensation factors were measured for layers {sorted(scales)} but the plan drops "
            f"{plan.dropped_indices}; this is a bug in the method, the model was not changed."
        )
    apply()
    kept = [g.indices[0] for g in plan.groups]
    layer_scales = []
    for original in kept:
        factor = 1.0
        for dropped, alpha in scales.items():
            if dropped > original:
                factor *= alpha
        layer_scales.append(factor)
    embedding_scale = 1.0
    for alpha in scales.values():
        embedding_scale *= alpha
    with context.timer("compensation"):
        fold_stream_scales_(adapter, plan.stack, layer_scales, embedding_scale)
    return {"kind": "scale", "alpha": {str(k): v for k, v in sorted(scales.items())}}
