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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.distributed import all_reduce_, all_reduce_sums, global_batches, is_sharded
from ..calibration.states import CalibratedStates
from ..ops.linear_map import (
    RIDGE_GRID,
    LinearMapStatistics,
    fit_cosine,
    fit_towards_prior,
    folded_map_prior,
    solve_diagonal,
    solve_least_squares,
    solve_least_squares_with_gain,
)
from ..options.corrections import BridgeOptions
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import edit_block_, is_offloaded
from ..utils.torch_utils import first_output
from .compensation import fold_stream_scales_


def require_bridgeable(adapter: ArchitectureAdapter, stack: str, what: str, estimator: str | None = None) -> None:
    """Refuses (before any change) a stack a bridge cannot be folded into: blocks that normalise after the residual
    add, a family whose MLP output does not take a fold (`down_fold`), and with ``estimator="lstsq_down"`` one
    without a single dense MLP whose down projection could be refitted (`dense_mlp`: a mixture of experts).

    Where a norm follows the MLP (`mlp_output_norm`: Gemma, OLMo-2, GLM-4), ``estimator="diagonal"`` is exact
    whatever the norms around it: the stream receives that norm's output, and a per-channel map after it is a
    rescaling of its gain."""
    if estimator == "diagonal" and adapter.mlp_output_norm is not None:
        return
    position = adapter.block(stack, 0).norm_position
    if position != "pre":
        diagonal = " or estimator 'diagonal' (it folds into the norm after the MLP)" if adapter.mlp_output_norm else ""
        raise UnsupportedArchitectureError(
            f"{what} folds a linear map into the down projection of the layer before the removed ones, which is "
            f"exact only when that layer adds its MLP output to an unnormalised residual stream (pre-norm); this "
            f"{type(adapter.model).__name__} stack {stack!r} is {position}-norm. Use a method without a linear "
            f"replacement (shortgpt, sleb, laco, sliding_window){diagonal} on it."
        )
    if missing := adapter.missing_capabilities({"down_fold"}):
        raise UnsupportedArchitectureError(
            f"{what} folds a linear map into the down projection of the layer before the removed ones, which "
            f"model_type {adapter.config.model_type!r} does not allow: {missing['down_fold']}. Use a method without "
            "a linear replacement (shortgpt, sleb, uidl) on it."
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


@contextlib.contextmanager
def capture_mlp(
    adapter: ArchitectureAdapter,
    module: torch.nn.Module,
    index: int,
    on_batch: Any,
    read: Literal["output", "down_input"] = "output",
) -> Iterator[None]:
    """While open, calls ``on_batch(x, y)`` on each forward of layer `module`, with y the stream the MLP sublayer
    adds to and x what it adds (``read="output"``: what ReplaceMe's T maps; the MLP's output, or its output norm's
    where one follows it, `mlp_write_points`) or the down projection's input, the intermediate activation
    (``read="down_input"``: what the down refit fits on)."""
    seen: dict[str, torch.Tensor] = {}
    written, stream = adapter.mlp_write_points(module, index)

    def stream_hook(_module: Any, args: tuple[Any, ...]) -> None:
        seen["y"] = args[0].detach()

    def output_hook(_module: Any, _args: Any, output: Any) -> None:
        on_batch(first_output(output).detach(), seen.pop("y"))

    def down_input_hook(_module: Any, args: tuple[Any, ...]) -> None:
        on_batch(args[0].detach(), seen.pop("y"))

    if read == "output":
        reader = written.register_forward_hook(output_hook)
    elif read == "down_input":
        reader = adapter.block_view(module, index).mlp.down.module.register_forward_pre_hook(down_input_hook)
    else:
        raise ValueError(f"read must be 'output' or 'down_input', got {read!r}.")
    handles = [stream.register_forward_pre_hook(stream_hook), reader]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_capturing_mlp(
    adapter: ArchitectureAdapter,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    on_batch: Any,
    read: Literal["output", "down_input"] = "output",
) -> None:
    """Runs `module` at `position` over every calibration batch with `capture_mlp` open, calling
    ``on_batch(b, x, y)`` with the batch index: the one walk every least-squares fit makes."""
    state = {"batch": 0}

    def add(x: torch.Tensor, y: torch.Tensor) -> None:
        on_batch(state["batch"], x, y)

    with capture_mlp(adapter, module, position, add, read=read):
        runner.run(module, position, inputs, on_batch=lambda b: state.update(batch=b))


def least_squares_fold_(
    adapter: ArchitectureAdapter,
    stack: str,
    k: int,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    options: BridgeOptions,
) -> dict[str, Any]:
    """One walk of layer k accumulating `BridgeFit`'s float64 statistics towards `target`, then its solve and fold
    into layer k (the least-squares estimators, ReplaceMe's T or the down refit alike); returns the report entry."""
    fit = BridgeFit(adapter, module, k, options, runner.num_batches, inputs[0].device)
    run_capturing_mlp(
        adapter,
        runner,
        module,
        position,
        inputs,
        lambda b, x, y: fit.add(b, x, y, target[b], runner.masks[b]),
        read=fit.read,
    )
    return fit.fold_(adapter, stack, k)


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


class BridgeFit:
    """The float64 statistics of one least-squares bridge, filled a batch at a time, then solved and folded once.

    Where the batches come from is the caller's: a run of the bridged layer over held states (`fit_and_fold_`) or a
    walk of the dense stack one batch at a time (`stream_bridge_statistics_`). Both add the same batches in the same
    order through `add`, so the two give the same sums, and the same map. ``"lstsq"`` and ``"lstsq_gain"`` read the
    MLP's output (MᵀM, Mᵀ(L − Y), and the stream's terms for the gain); ``"lstsq_down"`` reads the down projection's
    input, with the last batch's statistics apart when its ridge is to be chosen on it (see `_refit_down_from_`).

    Args:
        adapter, module, index: The bridged layer (its down projection's sizes, or its MLP's output width; its
            weights are read again when folding).
        options: The estimator (a least-squares one: the cosine fit needs the tokens themselves).
        num_batches: The calibration batches that will be added (the last is held out for a ridge choice).
        device: Where the statistics live.
    """

    def __init__(
        self,
        adapter: ArchitectureAdapter,
        module: torch.nn.Module,
        index: int,
        options: BridgeOptions,
        num_batches: int,
        device: torch.device | str,
    ) -> None:
        if options.estimator not in LEAST_SQUARES_ESTIMATORS:
            raise ValueError(
                f"BridgeFit accumulates least-squares statistics ({list(LEAST_SQUARES_ESTIMATORS)}); the estimator "
                f"{options.estimator!r} needs the tokens themselves."
            )
        self.options = options
        # What the stream receives is the captured output (or, for the down refit, the down projection's input)
        # times the block's multiplier (Granite's residual_multiplier; 1 elsewhere), and the fit is of that.
        self.scale = adapter.mlp_output_multiplier(module, index)
        self.refits_down = options.estimator == "lstsq_down"
        self.read: Literal["output", "down_input"] = "down_input" if self.refits_down else "output"
        self.held_out_batch: int | None = None
        self.held_out: LinearMapStatistics | None = None
        if self.refits_down:
            # The held-out batch is the last of all the calibration batches; under a sharded calibration it is on
            # the last rank, and every rank keeps held-out sums (zero where it has none) for the all-reduce.
            indices, total = global_batches(num_batches)
            if options.down_ridge is None and total > 1:
                self.held_out_batch = total - 1 - indices.start if total - 1 in indices else -1
            down = adapter.block_view(module, index).mlp.down
            intercept = down.bias is not None
            self.fit = LinearMapStatistics(
                down.in_features, device=device, out_dim=down.out_features, intercept=intercept
            )
            if self.held_out_batch is not None:
                self.held_out = LinearMapStatistics(
                    down.in_features, device=device, out_dim=down.out_features, intercept=intercept
                )
        else:
            width = adapter.mlp_output_width(module, index)
            self.fit = LinearMapStatistics(width, device=device, with_gain=options.stream_gain)

    def add(self, batch: int, x: torch.Tensor, y: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds one batch: x what the estimator reads (M, or the down projection's input A), y the MLP-norm input
        (the stream Y), `target` the dense state L at the span's end, `mask` the batch's real tokens."""
        into = self.held_out if batch == self.held_out_batch and self.held_out is not None else self.fit
        if self.scale != 1.0:
            x = x * self.scale
        into.update(x, target, mask, stream=y if into.with_gain else None, offset=y)

    def fold_(self, adapter: ArchitectureAdapter, stack: str, k: int) -> dict[str, Any]:
        """Solves once and folds into output layer k of `stack` (the plan applied); returns the report entry.

        Under a sharded calibration the statistics are summed over the ranks first: complete only then, they give
        every rank the same map."""
        for stats in (self.fit, self.held_out):
            if stats is not None:
                _all_reduce_statistics_(stats)
        block = adapter.block_view(adapter.layers(stack)[k], k)
        if self.refits_down:
            return _refit_down_from_(adapter, stack, k, block.mlp.down, self.fit, self.held_out, self.options)
        detail: dict[str, Any]
        if self.options.stream_gain:
            transform, gain, info = solve_least_squares_with_gain(self.fit)
            detail = {"tokens": self.fit.count, "jitter": info.jitter, "gain": gain}
            # α on the embeddings and on the o/down projections of layers 0..k scales the stream entering k's MLP
            # norm (which does not see it) and k's own MLP output; T / α on the down projection undoes the latter.
            scales = [gain if j <= k else 1.0 for j in range(adapter.num_layers(stack))]
            fold_stream_scales_(adapter, stack, scales, gain)
            transform = transform / gain
        else:
            solve = solve_diagonal if self.options.estimator == "diagonal" else solve_least_squares
            transform, info = solve(self.fit)
            detail = {"tokens": self.fit.count, "jitter": info.jitter}
        fold_into_down_(adapter, stack, k, transform)
        return detail


def _all_reduce_statistics_(stats: LinearMapStatistics) -> None:
    """Sums `stats` over the ranks of a sharded calibration (calibration/distributed.py); nothing otherwise."""
    if not is_sharded():
        return
    for tensor in (stats.gram, stats.cross, stats.stream_cross):
        if tensor is not None:
            all_reduce_(tensor)
    count, target_norm, stream_target, stream_norm = all_reduce_sums(
        stats.count, stats.target_norm, stats.stream_target, stats.stream_norm
    )
    stats.count, stats.target_norm = int(count), target_norm
    stats.stream_target, stats.stream_norm = stream_target, stream_norm


#: The estimators whose fit reduces to float64 statistics (`BridgeFit`), so their states can be streamed.
LEAST_SQUARES_ESTIMATORS = ("lstsq", "lstsq_gain", "lstsq_down", "diagonal")


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
        return least_squares_fold_(adapter, stack, k, runner, module, position, inputs, target, options)
    dim, scale = adapter.mlp_output_width(module, k), adapter.mlp_output_multiplier(module, k)
    ms: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    ls: list[torch.Tensor] = []

    def on_batch(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        keep = runner.masks[b].reshape(-1).to(m.device).bool()
        ms.append(m.reshape(-1, dim)[keep].float().cpu() * scale)
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


def fit_least_squares(
    adapter: ArchitectureAdapter,
    runner: Any,
    module: torch.nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    target: Sequence[torch.Tensor],
    on_capture: Any = None,
    estimator: str = "lstsq",
) -> tuple[torch.Tensor, float, Any, int]:
    """T with ``M T + Y ≈ target`` for `module` run at `position` on `inputs`: (T, gain, solve info, tokens).

    One run of the layer over every batch; M and Y are reduced to float64 statistics batch by batch, so no token
    matrix outlives its batch. `on_capture(b, m, y)`, if given, also sees each batch's M and Y. With ``"lstsq_gain"``
    T and a scalar α are fitted jointly for ``α Y + M T ≈ target``; otherwise the gain is 1. ``"diagonal"``
    restricts T to a gain per channel (`solve_diagonal`).
    """
    if estimator not in ("lstsq", "lstsq_gain", "diagonal"):
        raise ValueError(f"a search fits T by 'lstsq', 'lstsq_gain' or 'diagonal', not {estimator!r}.")
    with_gain = estimator == "lstsq_gain"
    width = adapter.mlp_output_width(module, position)
    stats = LinearMapStatistics(width, device=inputs[0].device, with_gain=with_gain)
    scale = adapter.mlp_output_multiplier(module, position)

    def on_batch(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        m = m * scale if scale != 1.0 else m
        stats.update(m, target[b], runner.masks[b], stream=y, offset=y)
        if on_capture is not None:
            on_capture(b, m, y)

    run_capturing_mlp(adapter, runner, module, position, inputs, on_batch)
    if with_gain:
        transform, gain, info = solve_least_squares_with_gain(stats)
        return transform, gain, info, stats.count
    transform, info = (solve_diagonal if estimator == "diagonal" else solve_least_squares)(stats)
    return transform, 1.0, info, stats.count


def _refit_down_from_(
    adapter: ArchitectureAdapter,
    stack: str,
    k: int,
    down: Any,
    fit: LinearMapStatistics,
    held_out: LinearMapStatistics | None,
    options: BridgeOptions,
) -> dict[str, Any]:
    """Replaces layer k's down projection by ``W'`` (and ``b'`` where it has a bias) minimising
    ``Σ‖a W'ᵀ + b' − (l − y)‖² + λ s ‖W' − W_T‖²`` over the real calibration tokens (estimator ``"lstsq_down"``),
    from the statistics `BridgeFit` accumulated: ``AᵀA`` (intermediate², one more row and column for a bias) and
    ``Aᵀ(L − Y)`` in float64, for the fitting and the held-out batches apart.

    ReplaceMe's T acts on the down projection's output, so its fold ``W_T = Tᵀ W_down`` is one candidate W' among
    all; fitting W' directly uses every direction of the intermediate activation a instead of only the hidden-size
    image the old W_down kept, with (intermediate × hidden) parameters where T has (hidden × hidden). The ridge
    towards W_T is what keeps the extra freedom from fitting the calibration text alone: λ = 0 is the plain refit,
    λ = ∞ ReplaceMe. With ``options.down_ridge`` None it is chosen from `RIDGE_GRID` by the squared error on the
    last calibration batch, fitted on the others, then refitted on all (``fit_towards_prior``); with one batch it
    is 0.
    """
    ridge = options.down_ridge
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
    estimator: str = "lstsq",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """T fitted on every batch for the layer at `position`, and that layer's output with T on the first `limit` batches.

    What a search needs to score a replacement without touching the layer: the output with T is ``Y + M T``
    (``α Y + M T`` with ``"lstsq_gain"``), computed from the captured M and Y (no second run of the layer, no folded
    copy).
    """
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep_scored(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        if b < limit:
            captured.append((m, y))

    transform, gain, _, _ = fit_least_squares(
        adapter, runner, module, position, inputs, targets, on_capture=keep_scored, estimator=estimator
    )
    outputs = [
        (gain * y.double() + m.double() @ transform.to(m.device)).to(y.dtype).to(inputs[0].device) for m, y in captured
    ]
    return transform, outputs


def fold_into_down_(adapter: ArchitectureAdapter, stack: str, index: int, transform: torch.Tensor) -> None:
    """Folds the row-vector map `transform` after layer `index`'s MLP output (`fold_after_mlp_`; offloaded layers
    too)."""
    edit_block_(
        adapter.layers(stack),
        index,
        lambda module: adapter.fold_after_mlp_(module, index, transform),
        memo={id(adapter.config): adapter.config},
    )


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
        fit = BridgeFit(adapter, states.layers[k], k, options, runner.num_batches, runner.inputs[0].device)
        with (
            context.timer("linear_replacement"),
            context.progress_bar(runner.num_batches, "linear replacement: streamed fit") as bar,
        ):
            stream_bridge_statistics_(adapter, states, k, end, fit, on_batch=lambda _b: bar.update())
        del states  # the dropped layers go with the plan, not with the engine
        apply()
        with context.timer("linear_replacement"):
            entry = fit.fold_(adapter, plan.stack, k)
        entry.update(output_layer=k, span=[first, end])
        return {"estimator": options.estimator, "states": "streamed", "maps": [entry], "unbridged_leading_layers": []}
    with context.timer("linear_replacement"):
        targets = dense_targets(states, plan, options.correct_after)
    del states
    apply()
    with context.timer("linear_replacement"):
        return fit_and_fold_(adapter, plan, runner, targets, options, seed)
