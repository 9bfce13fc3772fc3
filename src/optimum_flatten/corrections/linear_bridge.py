"""Linear replacement: bridge every span of removed or merged-away layers with one fitted map folded into a down
projection, so the checkpoint keeps a stock architecture.

After a plan is applied, output layer k covers the original layers from its group's first member up to (not
including) the next group's first member; call that its span. When a span holds more than one original layer (the
layers after it were dropped, or it is a merged group), ReplaceMe's construction applies to it: with M the MLP output
of output layer k, Y its residual stream before the MLP (the input of its MLP norm) and L the *dense* model's state at
the end of the span, fit T with ``M T + Y ≈ L`` and fold T into layer k's down projection. Layers are processed in
order on the compressed model, so each fit sees the inputs the compressed model really gives it (for one span this is
exactly ReplaceMe; for several, each later map also corrects what the earlier ones left).

A run of dropped layers at the very start of the stack has no layer before it and stays unbridged (reported).
The fold assumes a pre-norm residual stream (a block adds its MLP output to the stream unnormalised); post-norm
stacks are refused before any weight changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import CalibratedStates, HeldBlock
from ..ops.linear_map import fit_cosine
from ..options.corrections import BridgeOptions
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import is_offloaded
from .bridge_fit import (
    LEAST_SQUARES_ESTIMATORS,
    BridgeFit,
    FilledBridge,
    LayerRun,
    capture_mlp,
    fold_into_down_,
    run_capturing_mlp,
)
from .compensation import require_pre_norm


def _alternatives(adapter: ArchitectureAdapter, stack: str) -> str:
    """The methods that remove layers and run on `stack` without a bridge (`registry.runnable_methods`: a method
    folding one refuses the stack in its own preflight), as the refusal names them."""
    from ..registry import get_method_class, runnable_methods

    names = [name for name in runnable_methods(adapter, stack) if not get_method_class(name).keeps_depth]
    return ", ".join(names) or "none applies to this stack"


def require_bridgeable(adapter: ArchitectureAdapter, stack: str, what: str, estimator: str | None = None) -> None:
    """Refuses (before any change) a stack a bridge cannot be folded into: blocks that normalise after the residual
    add, a family whose MLP output does not take a fold (`down_fold`), and with ``estimator="lstsq_down"`` one
    without a single dense MLP whose down projection could be refitted (`dense_mlp`: a mixture of experts).

    Where a norm follows the MLP (`mlp_output_norm`: Gemma, OLMo-2, GLM-4), ``estimator="diagonal"`` is exact
    whatever the norms around it: the stream receives that norm's output, and a per-channel map after it is a
    rescaling of its gain."""
    if estimator == "diagonal" and adapter.mlp_output_norm is not None:
        return
    option = "linear_replacement='diagonal'" if what.startswith("linear_replacement") else "estimator 'diagonal'"
    diagonal = f" or {option} (it folds into the norm after the MLP)" if adapter.mlp_output_norm else ""
    require_pre_norm(
        adapter,
        stack,
        f"{what} folds a linear map into the down projection of the layer before the removed ones, which is exact "
        "only when that layer adds its MLP output to an unnormalised residual stream",
        f"Use a method without a linear replacement ({_alternatives(adapter, stack)}){diagonal} on it.",
    )
    if missing := adapter.missing_capabilities({"down_fold"}):
        raise UnsupportedArchitectureError(
            f"{what} folds a linear map into the down projection of the layer before the removed ones, which "
            f"model_type {adapter.config.model_type!r} does not allow: {missing['down_fold']}. Use a method without "
            f"a linear replacement ({_alternatives(adapter, stack)}) on it."
        )
    if estimator == "lstsq_down" and (missing := adapter.missing_capabilities({"dense_mlp"})):
        raise UnsupportedArchitectureError(
            f"{what} with estimator 'lstsq_down' refits the down projection of the layer before the removed ones, "
            f"and model_type {adapter.config.model_type!r} has none to refit: {missing['dense_mlp']}. Use estimator "
            "'lstsq' (the map folded after the MLP output) on it."
        )


def bridged_spans(plan: LayerPlan, correct_after: int = 0) -> list[tuple[int, int, int]]:
    """``(output index, first original layer, end)`` of every output layer whose span holds more than one layer,
    and of the `correct_after` output layers after each of them (spans of their own layer only)."""
    ends = plan.span_ends()
    bridged = [k for k, group in enumerate(plan.groups) if ends[k] - group.indices[0] > 1]
    chosen = sorted({j for k in bridged for j in range(k, min(k + 1 + correct_after, len(plan.groups)))})
    return [(k, plan.groups[k].indices[0], ends[k]) for k in chosen]


def dense_targets(states: CalibratedStates, plan: LayerPlan, correct_after: int = 0) -> dict[int, list[torch.Tensor]]:
    """The dense stack's states at the end of every fitted span, in one walk (before the plan is applied)."""
    wanted = {end for _, _, end in bridged_spans(plan, correct_after)}
    found: dict[int, list[torch.Tensor]] = {}
    if not wanted:
        return found
    for i, _, after in states.walk():
        if i + 1 in wanted:
            found[i + 1] = after
            if len(found) == len(wanted):
                break
    return found


@torch.no_grad()
def fit_and_fold_(
    adapter: ArchitectureAdapter,
    plan: LayerPlan,
    runner: Any,
    targets: dict[int, list[torch.Tensor]],
    options: BridgeOptions,
    seed: int = 0,
) -> dict[str, Any]:
    """Fits and folds one map per bridged span on the applied plan; returns the report entry.

    Args:
        adapter: The adapter of the model after `plan` was applied (before renumbering).
        plan: The applied plan (output layer k is ``plan.groups[k]``).
        runner: The runner recorded on the original model (its call arguments are looked up by original position).
        targets: `dense_targets` of the original model, taken before the plan was applied.
        options: The estimator.
        seed: Seeds the cosine fit's token order.
    """
    spans = {k: (first, end) for k, first, end in bridged_spans(plan, options.correct_after)}
    layers = adapter.layers(plan.stack)
    entries: list[dict[str, Any]] = []
    current: Sequence[torch.Tensor] = runner.inputs
    last = max(spans, default=-1)
    for k in range(last + 1):
        module, position = layers[k], plan.groups[k].indices[0]
        if k in spans:
            first, end = spans[k]
            entry = _fit_one(adapter, plan.stack, k, position, runner, current, targets[end], options, seed)
            entry.update(output_layer=k, span=[first, end])
            entries.append(entry)
            module = layers[k]  # an offloaded layer was replaced by its edited copy
            if "gain" in entry:
                # The fold scaled every writer of the stream up to layer k: the stream entering k is now α times
                # what was computed, and the edited layer k expects it so.
                current = [h * entry["gain"] for h in current]
        current = runner.run(module, position, current)
    leading = plan.groups[0].indices[0] if plan.groups else 0
    return {
        "estimator": options.estimator,
        "states": "held",
        "maps": entries,
        "unbridged_leading_layers": list(range(leading)),
    }


def _fit_one(
    adapter: ArchitectureAdapter,
    stack: str,
    k: int,
    position: int,
    runner: Any,
    inputs: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    options: BridgeOptions,
    seed: int,
) -> dict[str, Any]:
    module = adapter.layers(stack)[k]
    if options.estimator in LEAST_SQUARES_ESTIMATORS:
        # One walk of layer k accumulating `BridgeFit`'s float64 statistics towards `target`, then its solve and fold
        # into layer k (the least-squares estimators, ReplaceMe's T or the down refit alike).
        fit = BridgeFit(adapter, module, k, options, runner.num_batches, inputs[0].device)
        fit.add_run(LayerRun(adapter, runner, module, position, inputs, target))
        return fit.fold_(adapter, stack, k)
    dim = adapter.mlp_output_width(module, k)
    ms: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    ls: list[torch.Tensor] = []

    def on_batch(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        keep = runner.masks[b].reshape(-1).to(m.device).bool()
        ms.append(m.reshape(-1, dim)[keep].float().cpu())
        ys.append(y.reshape(-1, dim)[keep].float().cpu())
        ls.append(target[b].reshape(-1, dim)[keep.to(target[b].device)].float().cpu())

    run_capturing_mlp(adapter, runner, module, position, inputs, on_batch)
    fit_result = fit_cosine(
        ms,
        ys,
        ls,
        epochs=options.cosine_epochs,
        lr=options.cosine_lr,
        minibatch=options.cosine_minibatch,
        seed=seed,
    )
    fold_into_down_(adapter, stack, k, fit_result.transform)
    return {
        "tokens": sum(x.shape[0] for x in ms),
        "optimizer_steps": fit_result.steps,
        "cosine_distance_before": round(fit_result.loss_before, 6),
        "cosine_distance_after": round(fit_result.loss_after, 6),
    }


def streamed_span(adapter: ArchitectureAdapter, plan: LayerPlan, options: BridgeOptions) -> tuple[int, int, int] | None:
    """``(output index, first original layer, end)`` of the one bridge whose fit can stream, or None.

    Streaming (`stream_bridge_statistics_`) walks the *dense* stack a batch at a time and reads the bridged layer's
    MLP on the way, so it needs: a least-squares estimator (the cosine fit is Adam over the tokens themselves), one
    fitted span (a later span's inputs depend on the earlier spans' maps, which exist only once every batch was
    seen), every output layer up to the bridged one the original layer at its own index (so the compressed model
    feeds that layer what the dense one does: no merge, no drop before it), and none of the walked layers offloaded
    (a walk per batch would bring each one in once per batch instead of once).
    """
    if options.estimator not in LEAST_SQUARES_ESTIMATORS:
        return None
    spans = bridged_spans(plan, options.correct_after)
    if len(spans) != 1:
        return None
    k, first, end = spans[0]
    if any(tuple(plan.groups[j].indices) != (j,) for j in range(k + 1)):
        return None
    layers = adapter.layers(plan.stack)
    if any(is_offloaded(layers[i]) for i in range(end)):
        return None
    return k, first, end


@torch.no_grad()
def stream_bridge_statistics_(
    adapter: ArchitectureAdapter,
    states: CalibratedStates,
    k: int,
    end: int,
    fit: BridgeFit,
    on_batch: Callable[[int], None] | None = None,
) -> None:
    """Fills `fit` for the bridge of layer k across ``[k + 1, end)`` in one walk of the dense stack, batch by batch.

    Batch b runs through layers 0..end−1 alone; on the way the bridged layer k's MLP is read (M or A, and Y), and
    the state after layer end − 1 is the target L; the batch is added to the statistics and dropped before the next
    one starts. So at most one batch's states are alive (the held path keeps the targets of every batch, the
    propagated states and a run's outputs: three copies of the calibration states), and layers 0..k run once (the
    held path runs them on the dense and on the compressed model). Each batch goes through the layers op for op as
    `LayerwiseRunner.run` takes it (`CalibratedStates.run_layers_on_batch`), and the batches are added in order, so
    the statistics, and the map, are the held path's.
    """
    runner = states.runner
    captured: dict[str, torch.Tensor] = {}
    with capture_mlp(adapter, states.layers[k], k, lambda x, y: captured.update(x=x, y=y), read=fit.read):
        for b, hidden in enumerate(runner.inputs):
            target = states.run_layers_on_batch(range(end), hidden, b)
            fit.add(b, captured.pop("x"), captured.pop("y"), target, runner.masks[b])
            if on_batch is not None:
                on_batch(b)


def bridged_apply_(
    adapter: ArchitectureAdapter,
    plan: LayerPlan,
    context: Any,
    options: BridgeOptions,
    apply: Any,
    seed: int = 0,
    stream: bool | None = None,
    held: HeldBlock | FilledBridge | None = None,
) -> dict[str, Any]:
    """Fits the bridges of `plan`, runs `apply()` (which applies `plan`), then folds them.

    When the fit can stream (`streamed_span`: one least-squares bridge after an unchanged prefix, ReplaceMe's own
    case), its statistics are accumulated before `apply()` by one walk of the dense stack a batch at a time, and
    solved and folded after it. Otherwise the dense targets are taken before `apply()` and every bridge is fitted
    in order on the compressed model (`fit_and_fold_`), holding the states. `stream` False forces the held path
    (the reference the streamed one is tested against); True refuses a plan that cannot stream.

    The runner is the plan's own when it can stand for a fresh one (`MethodContext.states_of_unchanged_model`),
    recorded on the original model before `apply()`; its per-position call arguments stay valid afterwards because
    layers are looked up by their original index.

    `held` (the `HeldBlock` of the plan's block: the dense states entering the bridged layer and leaving
    the block, kept by the selection walk) replaces the streamed walk: the bridged layer alone runs on them, with
    the statistics added batch by batch in the same order, so the map is the streamed one's. A `FilledBridge` of
    the plan's block (its statistics already complete, from ReplaceMe's one-pass walk) replaces it too: the fit is
    the solve and the fold.
    """
    states = context.states_of_unchanged_model(adapter, keep=())  # nothing is changed before `apply()`
    runner = states.runner
    span = streamed_span(adapter, plan, options) if stream is not False else None
    if stream and span is None:
        raise ValueError(
            f"the fit of this plan cannot stream (estimator {options.estimator!r}, spans "
            f"{[[first, end] for _, first, end in bridged_spans(plan, options.correct_after)]}): streaming needs a "
            "least-squares estimator, one bridge, no merged or dropped layer before it and no offloaded layer. "
            "Pass stream=None to choose automatically."
        )
    if span is not None:
        k, first, end = span
        from_held = held is not None and (held.start - 1, held.start + held.size) == (k, end)
        filled = from_held and isinstance(held, FilledBridge)  # every batch already added by the selection's walk
        if filled:
            fit = held.fit
        else:
            fit = BridgeFit(adapter, states.layers[k], k, options, runner.num_batches, runner.inputs[0].device)
            with context.timer("linear_replacement"):
                if from_held:  # the layer before the block on its held input, towards the held output
                    fit.add_run(LayerRun(adapter, runner, states.layers[k], k, held.before, held.after))
                else:
                    with context.progress_bar(runner.num_batches, "linear replacement: streamed fit") as bar:
                        stream_bridge_statistics_(adapter, states, k, end, fit, on_batch=lambda _b: bar.update())
        del states, held  # the dropped layers go with the plan, not with the engine
        apply()
        with context.timer("linear_replacement"):
            entry = fit.fold_(adapter, plan.stack, k)
        entry.update(output_layer=k, span=[first, end])
        how = "one pass with the selection" if filled else "held by the selection" if from_held else "streamed"
        return {"estimator": options.estimator, "states": how, "maps": [entry], "unbridged_leading_layers": []}
    with context.timer("linear_replacement"):
        targets = dense_targets(states, plan, options.correct_after)
    del states
    apply()
    with context.timer("linear_replacement"):
        return fit_and_fold_(adapter, plan, runner, targets, options, seed)
