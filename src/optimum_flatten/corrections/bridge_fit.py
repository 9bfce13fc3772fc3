"""One least-squares bridge: what it reads (the MLP's write to the stream and the stream, `capture_mlp`), its
float64 statistics filled a batch at a time (`BridgeFit`), the solve, and the fold into the layer
(`fold_into_down_`, the adapter's `fold_after_mlp_`). `corrections.linear_bridge` decides which spans get one and
where their batches come from; the searches that score a replacement without folding it (`fit_with_outputs`) use
the same fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.distributed import all_reduce_, all_reduce_sums, global_batches, is_sharded
from ..ops.linear_map import (
    RIDGE_GRID,
    LinearMapStatistics,
    fit_towards_prior,
    folded_map_prior,
    solve_diagonal,
    solve_least_squares,
    solve_least_squares_with_gain,
)
from ..options.corrections import BridgeOptions
from ..utils.offload import edit_block_, onloaded
from ..utils.torch_utils import first_output
from .compensation import fold_stream_scales_

#: The estimators whose fit reduces to float64 statistics (`BridgeFit`), so their states can be streamed.
LEAST_SQUARES_ESTIMATORS = ("lstsq", "lstsq_gain", "lstsq_down", "diagonal")


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
    (``read="down_input"``: what the down refit fits on).

    x is scaled by the block's `mlp_output_multiplier` (Granite's residual multiplier; 1 elsewhere) here, the one
    place every fit reads it, so that each fit is of what the stream receives."""
    seen: dict[str, torch.Tensor] = {}
    written, stream = adapter.mlp_write_points(module, index)
    scale = adapter.mlp_output_multiplier(module, index)

    def stream_hook(_module: Any, args: tuple[Any, ...]) -> None:
        seen["y"] = args[0].detach()

    def emit(x: torch.Tensor) -> None:
        on_batch(x * scale if scale != 1.0 else x, seen.pop("y"))

    def output_hook(_module: Any, _args: Any, output: Any) -> None:
        emit(first_output(output).detach())

    def down_input_hook(_module: Any, args: tuple[Any, ...]) -> None:
        emit(args[0].detach())

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


@dataclass(frozen=True)
class LayerRun:
    """One run of a bridged layer over held states, towards held targets: what every least-squares fit of a bridge
    reads. `module` is the layer at `position`, `runner` runs it batch by batch over `inputs` (and holds each batch's
    mask), and ``targets[b]`` is the dense state batch b should reach."""

    adapter: ArchitectureAdapter
    runner: Any
    module: torch.nn.Module
    position: int
    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]

    def capture(self, on_batch: Any, read: Literal["output", "down_input"] = "output") -> None:
        """Runs the layer over every batch with `capture_mlp` open (`run_capturing_mlp`)."""
        run_capturing_mlp(self.adapter, self.runner, self.module, self.position, self.inputs, on_batch, read=read)


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

    @property
    def nbytes(self) -> int:
        """Bytes of the statistics (and of the held-out batch's): what a fit kept across batches costs."""
        sets = [s for s in (self.fit, self.held_out) if s is not None]
        tensors = [t for s in sets for t in (s.gram, s.cross, s.stream_cross) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def add(self, batch: int, x: torch.Tensor, y: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds one batch: x what the estimator reads (M, or the down projection's input A), y the MLP-norm input
        (the stream Y), `target` the dense state L at the span's end, `mask` the batch's real tokens."""
        into = self.held_out if batch == self.held_out_batch and self.held_out is not None else self.fit
        into.update(x, target, mask, stream=y if into.with_gain else None, offset=y)

    def add_run(self, run: LayerRun) -> None:
        """Adds every batch of `run`, the bridged layer over held inputs towards held targets: the held path's walk
        (`linear_bridge.fit_and_fold_`, or states a selection held)."""
        masks = run.runner.masks
        run.capture(lambda b, x, y: self.add(b, x, y, run.targets[b], masks[b]), read=self.read)

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


@dataclass
class FilledBridge:
    """The statistics of the bridge of layer ``start − 1`` across the block ``[start, start + size)``, every
    calibration batch already added (by ReplaceMe's one-pass walk, `methods.replaceme_one_pass`): the fit is a solve."""

    start: int
    size: int
    fit: BridgeFit


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
    with onloaded(adapter.layers(stack)[k]):  # an offloaded layer's weight is a meta tensor outside this block
        weight, bias = down.weight, down.bias
        lifted = (weight.T if bias is None else torch.cat([weight.T, bias[None]], dim=0)).clone()
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


def fold_into_down_(adapter: ArchitectureAdapter, stack: str, index: int, transform: torch.Tensor) -> None:
    """Folds the row-vector map `transform` after layer `index`'s MLP output (`fold_after_mlp_`; offloaded layers
    too)."""
    edit_block_(
        adapter.layers(stack),
        index,
        lambda module: adapter.fold_after_mlp_(module, index, transform),
        memo={id(adapter.config): adapter.config},
    )


def fit_with_outputs(run: LayerRun, limit: int, estimator: str = "lstsq") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """T fitted on every batch of `run`, and its layer's output with T on the first `limit` batches.

    What a search needs to score a replacement without touching the layer: T with ``M T + Y ≈ target`` from one run
    of the layer over every batch, M and Y reduced to float64 statistics batch by batch (no token matrix outlives its
    batch but those of the scored ones); the output with T is ``Y + M T``, computed from the captured M and Y (no
    second run of the layer, no folded copy). With ``"lstsq_gain"`` T and a scalar α are fitted jointly for
    ``α Y + M T ≈ target`` and the output is ``α Y + M T``; ``"diagonal"`` restricts T to a gain per channel
    (`solve_diagonal`).
    """
    if estimator not in ("lstsq", "lstsq_gain", "diagonal"):
        raise ValueError(f"a search fits T by 'lstsq', 'lstsq_gain' or 'diagonal', not {estimator!r}.")
    with_gain = estimator == "lstsq_gain"
    width = run.adapter.mlp_output_width(run.module, run.position)
    device = run.inputs[0].device
    stats = LinearMapStatistics(width, device=device, with_gain=with_gain)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_batch(b: int, m: torch.Tensor, y: torch.Tensor) -> None:
        stats.update(m, run.targets[b], run.runner.masks[b], stream=y, offset=y)
        if b < limit:
            captured.append((m, y))

    run.capture(on_batch)
    if with_gain:
        transform, gain, _ = solve_least_squares_with_gain(stats)
    else:
        transform, _ = (solve_diagonal if estimator == "diagonal" else solve_least_squares)(stats)
        gain = 1.0
    outputs = [(gain * y.double() + m.double() @ transform.to(m.device)).to(y.dtype).to(device) for m, y in captured]
    return transform, outputs
