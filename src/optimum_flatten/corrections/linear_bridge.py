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

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import CalibratedStates
from ..ops.linear_map import (
    RIDGE_GRID,
    LinearMapStatistics,
    fit_cosine,
    fit_towards_prior,
    fold_map_into_linear,
    folded_map_prior,
    solve_least_squares,
    solve_least_squares_with_gain,
)
from ..options.corrections import BridgeOptions
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import edit_block_
from ..utils.torch_utils import first_output
from .compensation import fold_stream_scales_


def require_pre_norm(adapter: ArchitectureAdapter, stack: str, what: str) -> None:
    """Refuses (before any change) a stack whose blocks normalise after the residual add."""
    position = adapter.block(stack, 0).norm_position
    if position != "pre":
        raise UnsupportedArchitectureError(
            f"{what} folds a linear map into the down projection of the layer before the removed ones, which is "
            f"exact only when that layer adds its MLP output to an unnormalised residual stream (pre-norm); this "
            f"{type(adapter.model).__name__} stack {stack!r} is {position}-norm. Use a method without a linear "
            "replacement (shortgpt, sleb, laco, sliding_window) on it."
        )
    if missing := adapter.missing_capabilities({"down_fold"}):
        raise UnsupportedArchitectureError(
            f"{what} folds a linear map into the down projection of the layer before the removed ones, which "
            f"model_type {adapter.config.model_type!r} does not allow: {missing['down_fold']}. Use a method without "
            "a linear replacement (shortgpt, sleb, uidl) on it."
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


@contextlib.contextmanager
def capture_mlp(block: Any, on_batch: Any, read: Literal["output", "down_input"] = "output") -> Iterator[None]:
    """While open, calls ``on_batch(x, y)`` on each forward, with y the MLP-norm input and x the MLP's output
    (``read="output"``: what ReplaceMe's T maps) or the down projection's input, the intermediate activation
    (``read="down_input"``: what the down refit fits on)."""
    seen: dict[str, torch.Tensor] = {}

    def norm_hook(_module: Any, args: tuple[Any, ...]) -> None:
        seen["y"] = args[0].detach()

    def output_hook(_module: Any, _args: Any, output: Any) -> None:
        on_batch(first_output(output).detach(), seen.pop("y"))

    def down_input_hook(_module: Any, args: tuple[Any, ...]) -> None:
        on_batch(args[0].detach(), seen.pop("y"))

    if read == "output":
        reader = block.mlp.module.register_forward_hook(output_hook)
    elif read == "down_input":
        reader = block.mlp.down.module.register_forward_pre_hook(down_input_hook)
    else:
        raise ValueError(f"read must be 'output' or 'down_input', got {read!r}.")
    handles = [block.mlp_norm.module.register_forward_pre_hook(norm_hook), reader]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
    block = adapter.block_view(module, k)
    dim = block.mlp.down.out_features
    state = {"batch": 0}
    if options.estimator == "lstsq_down":
        return refit_down_(adapter, stack, k, block, runner, module, position, inputs, target, options.down_ridge)
    if options.estimator in ("lstsq", "lstsq_gain"):
        transform, gain, info, count = fit_least_squares(
            block, runner, module, position, inputs, target, with_gain=options.stream_gain
        )
        detail: dict[str, Any] = {"tokens": count, "jitter": info.jitter}
        if options.stream_gain:
            detail["gain"] = gain
            # α on the embeddings and on the o/down projections of layers 0..k scales the stream entering k's MLP
            # norm (which does not see it) and k's own MLP output; T / α on the down projection undoes the latter.
            scales = [gain if j <= k else 1.0 for j in range(adapter.num_layers(stack))]
            fold_stream_scales_(adapter, stack, scales, gain)
            transform = transform / gain
    else:
        ms: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        ls: list[torch.Tensor] = []

        def on_batch(m: torch.Tensor, y: torch.Tensor) -> None:
            b = state["batch"]
            keep = runner.masks[b].reshape(-1).to(m.device).bool()
            ms.append(m.reshape(-1, dim)[keep].float().cpu())
            ys.append(y.reshape(-1, dim)[keep].float().cpu())
            ls.append(target[b].reshape(-1, dim)[keep.to(target[b].device)].float().cpu())

        with capture_mlp(block, on_batch):
            runner.run(module, position, inputs, on_batch=lambda b: state.update(batch=b))
        fit = fit_cosine(
            ms,
            ys,
            ls,
            epochs=options.cosine_epochs,
            lr=options.cosine_lr,
            minibatch=options.cosine_minibatch,
            seed=seed,
        )
        transform = fit.transform
        detail = {
            "tokens": sum(x.shape[0] for x in ms),
            "optimizer_steps": fit.steps,
            "cosine_distance_before": round(fit.loss_before, 6),
            "cosine_distance_after": round(fit.loss_after, 6),
        }
    fold_into_down_(adapter, stack, k, transform)
    return detail


def fit_least_squares(
    block: Any,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    on_capture: Any = None,
    with_gain: bool = False,
) -> tuple[torch.Tensor, float, Any, int]:
    """T with ``M T + Y ≈ target`` for `module` run at `position` on `inputs`: (T, gain, solve info, tokens).

    One run of the layer over every batch; M and Y are reduced to float64 statistics batch by batch, so no token
    matrix outlives its batch. `on_capture(b, m, y)`, if given, also sees each batch's M and Y. With `with_gain`,
    T and a scalar α are fitted jointly for ``α Y + M T ≈ target``; otherwise the gain is 1.
    """
    stats = LinearMapStatistics(block.mlp.down.out_features, device=inputs[0].device, with_gain=with_gain)
    state = {"batch": 0}

    def on_batch(m: torch.Tensor, y: torch.Tensor) -> None:
        b = state["batch"]
        stats.update(m, target[b].to(m.device, torch.float64) - y.to(torch.float64), runner.masks[b], stream=y)
        if on_capture is not None:
            on_capture(b, m, y)

    with capture_mlp(block, on_batch):
        runner.run(module, position, inputs, on_batch=lambda b: state.update(batch=b))
    if with_gain:
        transform, gain, info = solve_least_squares_with_gain(stats)
        return transform, gain, info, stats.count
    transform, info = solve_least_squares(stats)
    return transform, 1.0, info, stats.count


def refit_down_(
    adapter: ArchitectureAdapter,
    stack: str,
    k: int,
    block: Any,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    ridge: float | None = None,
) -> dict[str, Any]:
    """Replaces layer k's down projection by ``W'`` (and ``b'`` where it has a bias) minimising
    ``Σ‖a W'ᵀ + b' − (l − y)‖² + λ s ‖W' − W_T‖²`` over the real calibration tokens: estimator ``"lstsq_down"``.

    ReplaceMe's T acts on the down projection's output, so its fold ``W_T = Tᵀ W_down`` is one candidate W' among
    all; fitting W' directly uses every direction of the intermediate activation a instead of only the hidden-size
    image the old W_down kept, with (intermediate × hidden) parameters where T has (hidden × hidden). The ridge
    towards W_T is what keeps the extra freedom from fitting the calibration text alone: λ = 0 is the plain refit,
    λ = ∞ ReplaceMe. With `ridge` None it is chosen from `RIDGE_GRID` by the squared error on the last calibration
    batch, fitted on the others, then refitted on all (``fit_towards_prior``); with one batch it is 0. One run of
    the layer; ``AᵀA`` (intermediate², one more row and column for a bias) and ``Aᵀ(L − Y)`` in float64, for the
    fitting and the held-out batches apart.
    """
    down = block.mlp.down
    held_out_batch = runner.num_batches - 1 if ridge is None and runner.num_batches > 1 else None

    def statistics() -> LinearMapStatistics:
        return LinearMapStatistics(
            down.in_features, device=inputs[0].device, out_dim=down.out_features, intercept=down.bias is not None
        )

    fit, held_out = statistics(), statistics() if held_out_batch is not None else None
    state = {"batch": 0}

    def on_batch(a: torch.Tensor, y: torch.Tensor) -> None:
        b = state["batch"]
        into = held_out if b == held_out_batch else fit
        into.update(a, target[b].to(a.device, torch.float64) - y.to(torch.float64), runner.masks[b])

    with capture_mlp(block, on_batch, read="down_input"):
        runner.run(module, position, inputs, on_batch=lambda b: state.update(batch=b))
    lifted = down.weight.T if down.bias is None else torch.cat([down.weight.T, down.bias[None]], dim=0)
    ridges = RIDGE_GRID if ridge is None else (ridge,)
    solution, choice = fit_towards_prior(fit, held_out, folded_map_prior(lifted), ridges=ridges)
    weight = solution[: down.in_features].T
    bias = solution[down.in_features] if fit.intercept else None

    def edit(edited: torch.nn.Module) -> None:
        view = adapter.block_view(edited, k).mlp.down
        view.set_(weight.to(view.weight.device), None if bias is None else bias.to(view.weight.device))

    edit_block_(adapter.layers(stack), k, edit, memo={id(adapter.config): adapter.config})
    detail: dict[str, Any] = {
        "tokens": fit.count,
        "jitter": choice.jitter,
        "refitted": "down_projection",
        "ridge": choice.ridge,
        "ridge_chosen_on": (
            "given"
            if ridge is not None
            else "the last calibration batch"
            if choice.held_out_errors is not None
            else "none held out (one calibration batch)"
        ),
    }
    if choice.held_out_errors is not None:
        detail["held_out_errors"] = {str(r): e for r, e in choice.held_out_errors.items()}
    return detail


def fit_with_outputs(
    adapter: ArchitectureAdapter,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    limit: int,
    with_gain: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """T fitted on every batch for the layer at `position`, and that layer's output with T on the first `limit` batches.

    What a search needs to score a replacement without touching the layer: the output with T is ``Y + M T``
    (``α Y + M T`` `with_gain`), computed from the captured M and Y (no second run of the layer, no folded copy).
    """
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep_scored(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        if b < limit:
            captured.append((m, y))

    block = adapter.block_view(module, position)
    transform, gain, _, _ = fit_least_squares(
        block, runner, module, position, inputs, targets, on_capture=keep_scored, with_gain=with_gain
    )
    outputs = [
        (gain * y.double() + m.double() @ transform.to(m.device)).to(y.dtype).to(inputs[0].device) for m, y in captured
    ]
    return transform, outputs


def fold_into_down_(adapter: ArchitectureAdapter, stack: str, index: int, transform: torch.Tensor) -> None:
    """Folds the row-vector map `transform` after layer `index`'s down projection (offloaded layers too)."""

    def edit(module: torch.nn.Module) -> None:
        down = adapter.block_view(module, index).mlp.down
        weight, bias = fold_map_into_linear(down.weight, down.bias, transform.to(down.weight.device))
        down.set_(weight, bias)

    edit_block_(adapter.layers(stack), index, edit, memo={id(adapter.config): adapter.config})


def bridged_apply_(
    adapter: ArchitectureAdapter, plan: LayerPlan, context: Any, options: BridgeOptions, apply: Any, seed: int = 0
) -> dict[str, Any]:
    """Takes the dense targets, runs `apply()` (which applies `plan`), then fits and folds every bridge.

    The runner is recorded on the original model before `apply()`; its per-position call arguments stay valid
    afterwards because layers are looked up by their original index.
    """
    states = context.new_states(adapter, keep=())
    with context.timer("linear_replacement"):
        targets = dense_targets(states, plan, options.correct_after)
    apply()
    with context.timer("linear_replacement"):
        return fit_and_fold_(adapter, plan, states.runner, targets, options, seed)
