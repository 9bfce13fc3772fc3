"""Step 3 of LayerCollapse: merge each prepared MLP whose α reached 1 into one linear map, and the method that
does it inside `FlattenQuantizer`.

Once the activation between an MLP's two maps is the identity, the MLP is ``W2·(W1·x + b1) + b2`` = ``W·x + b`` with
``W = W2·W1`` and ``b = W2·b1 + b2`` (`ops.collapse_linear_pair`, pure maths). What this module adds is the guard
(every α within `threshold` of 1, checked for every MLP before any weight changes, since a collapse cannot be
undone), the error measured on calibration activations, and the write through the adapter.

The method keeps every layer (``keeps_depth = True``): its plan is the identity and what it collapsed is reported
under ``report["layer_collapse"]``. Its lifecycle hooks name the package's own checkpoint writer (`export`), the
card section, and the adoption of a model reloaded from a remote-code checkpoint (`reload`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ...adapters import get_adapter
from ...adapters.base import ArchitectureAdapter
from ...adapters.views import BlockView
from ...calibration.capture import LayerwiseRunner, capture_module_inputs
from ...calibration.data import CalibrationBatch
from ...compression.method import CardSection, CheckpointWriter, CompressionMethod, MethodContext
from ...ops.linear_collapse import BatchNormStats, collapse_error, collapse_error_bound, collapse_linear_pair
from ...plan import LayerPlan
from ...registry import register_method
from ...utils.errors import NotCollapsibleError, UnsupportedArchitectureError
from ...utils.torch_utils import count_parameters
from .activation import ParametricActivation
from .config import METHOD_NAME, LayerCollapseConfig
from .export import stock_format_problem, stock_identity_parameters, write_layer_collapse_model
from .mlp import collapse_mlp_
from .prepare import check_not_gated, collapsed_mlp_indices, prepared_mlps, single_stack
from .reload import adopt_reloaded_

logger = logging.getLogger(__name__)

#: Report key of the per-MLP collapse record (in `FlattenQuantizer.report` and flatten_report.json).
REPORT_KEY = METHOD_NAME


# ---------------------------------------------------------------------------------------------- readiness
def _check_threshold(threshold: float) -> None:
    if not threshold > 0:
        raise ValueError(f"threshold must be positive (collapse when |1 - alpha| < threshold), got {threshold}.")


def _distance_to_identity(module: ParametricActivation) -> float:
    """``|1 − α|``: how far the activation is from the identity that makes the merge exact."""
    if not isinstance(module, ParametricActivation):
        raise TypeError(f"expected a ParametricActivation, got {type(module).__name__}.")
    return abs(1.0 - float(module.current_alpha().detach()))


def collapse_ready(modules: Sequence[ParametricActivation], threshold: float = 1e-4) -> list[bool]:
    """For each module, whether its activation is linear enough to collapse: ``|1 − α| < threshold``.

    Raises:
        ValueError: threshold is not positive.
        TypeError: an item is not a ParametricActivation.
    """
    _check_threshold(threshold)
    return [_distance_to_identity(module) < threshold for module in modules]


def require_collapse_ready(module: ParametricActivation, threshold: float = 1e-4, name: str | None = None) -> None:
    """Raises NotCollapsibleError, stating α, unless ``|1 − α| < threshold``."""
    _check_threshold(threshold)
    distance = _distance_to_identity(module)
    if distance >= threshold:
        alpha = float(module.current_alpha().detach())
        where = f" {name}" if name else ""
        raise NotCollapsibleError(
            f"cannot collapse the MLP of activation{where}: its activation is still nonlinear, alpha = {alpha:.6g} "
            f"(|1 - alpha| = {distance:.3g}, threshold {threshold:g}). Collapsing needs |1 - alpha| < threshold. "
            "Train longer or with a larger lc (LayerCollapseTrainer or AdamLC), or accept the error with a larger "
            "threshold after checking ops.collapse_error on calibration data."
        )


def collapse_linearised_pair(
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: ParametricActivation,
    threshold: float = 1e-4,
    between: BatchNormStats | None = None,
    after: BatchNormStats | None = None,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ops.collapse_linear_pair` guarded by the collapse condition on the activation between the two maps.

    Raises:
        NotCollapsibleError: ``|1 − α| ≥ threshold``; the message states α.
    """
    require_collapse_ready(activation, threshold, name)
    return collapse_linear_pair(w1, b1, w2, b2, between=between, after=after)


def _not_ready(activations: Mapping[int, ParametricActivation], threshold: float) -> list[tuple[int, float]]:
    """(layer, α) of every activation with ``|1 − α| ≥ threshold`` (or α not a number)."""
    return [
        (index, float(activation.current_alpha().detach()))
        for index, activation in activations.items()
        if not _distance_to_identity(activation) < threshold
    ]


def require_all_ready(activations: Mapping[int, ParametricActivation], threshold: float) -> None:
    """Raises NotCollapsibleError naming every layer whose α is not within `threshold` of 1 (and its α)."""
    waiting = _not_ready(activations, threshold)
    if waiting:
        listed = ", ".join(f"layer {i}: alpha = {a:.6g} (|1 - alpha| = {abs(1.0 - a):.3g})" for i, a in waiting)
        raise NotCollapsibleError(
            f"cannot collapse: {len(waiting)} prepared MLP(s) are still nonlinear ({listed}); collapsing needs "
            f"|1 - alpha| < threshold = {threshold:g} for every prepared MLP. Nothing was changed. Train longer or "
            "with a larger lc (build_layer_collapse_trainer), or raise the threshold after checking the measured "
            "error (ops.collapse_error) on calibration data."
        )


def _mlp_maps(block: BlockView) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    mlp = block.mlp
    return mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias


@torch.no_grad()
def measure_collapse_errors(
    adapter: ArchitectureAdapter, stack: str, indices: Sequence[int], runner: LayerwiseRunner
) -> dict[int, dict[str, float]]:
    """Error bound and measured error of collapsing each MLP in `indices`, on the calibration activations.

    Runs the stack as it is (α as trained) up to the last index, capturing each selected MLP's input on the real
    (unmasked) tokens; the figures are ``ops.collapse_error_bound`` and ``ops.collapse_error`` (absolute and
    relative to the MLP's output), all Frobenius norms over the calibration tokens.
    """
    wanted = set(indices)
    results: dict[int, dict[str, float]] = {}
    states = runner.inputs
    for i in range(max(indices) + 1):
        block = adapter.block(stack, i)
        captured: list[torch.Tensor] = []
        with capture_module_inputs(block.mlp.up.module, captured.append) if i in wanted else contextlib.nullcontext():
            states = runner.run(block.module, i, states)
        if i not in wanted:
            continue
        tokens = torch.cat([x[mask.to(x.device).bool()] for x, mask in zip(captured, runner.masks, strict=True)], dim=0)
        w1, b1, w2, b2 = _mlp_maps(block)
        activation = block.mlp.activation
        alpha = activation.current_alpha().detach()
        error = collapse_error(tokens, w1, b1, w2, b2, activation.base, alpha, relative=False)
        relative = collapse_error(tokens, w1, b1, w2, b2, activation.base, alpha, relative=True)
        bound = collapse_error_bound(tokens, w1, b1, w2, activation.base, alpha)
        results[i] = {
            "error_bound": float(bound),
            "error": float(error),
            "relative_error": float(relative),
            "tokens": int(tokens.shape[0]),
        }
    return results


def _collapse_one_(adapter: ArchitectureAdapter, stack: str, index: int, threshold: float) -> dict[str, Any]:
    """Merges one prepared MLP's maps (the readiness is checked again right before the write)."""
    block = adapter.block(stack, index)
    require_all_ready({index: block.mlp.activation}, threshold)
    alpha = float(block.mlp.activation.current_alpha().detach())
    before = count_parameters(block.mlp.module)
    weight, bias = collapse_linear_pair(*_mlp_maps(block))
    collapse_mlp_(block, weight, bias)
    after = count_parameters(adapter.block(stack, index).mlp.module)
    return {"layer": index, "alpha": alpha, "parameters_before": before, "parameters_after": after}


def _collapse_record(
    adapter: ArchitectureAdapter,
    stack: str,
    indices: Sequence[int],
    threshold: float,
    errors: Mapping[int, dict[str, float]],
) -> list[dict[str, Any]]:
    records = []
    for index in indices:
        record = {**_collapse_one_(adapter, stack, index, threshold), **errors.get(index, {})}
        records.append(record)
        logger.info(
            "layer_collapse: collapsed the MLP of layer %d (alpha %.6g, %d -> %d parameters, relative error %s)",
            index,
            record["alpha"],
            record["parameters_before"],
            record["parameters_after"],
            f"{record['relative_error']:.3g}" if "relative_error" in record else "not measured",
        )
    return records


def _collapse_targets(
    adapter: ArchitectureAdapter, stack: str, config: LayerCollapseConfig
) -> dict[int, ParametricActivation]:
    """The prepared MLPs to collapse, checked against the config's selection when it has one."""
    prepared = prepared_mlps(adapter, stack)
    if not prepared:
        raise ValueError(
            "no MLP of this model is prepared for LayerCollapse (no ParametricActivation found). Run "
            "prepare_layer_collapse_(model, num_mlps=...) and train alpha towards 1 first "
            "(build_layer_collapse_trainer or train_to_linear, in optimum_flatten.methods.layer_collapse); on the "
            "command line, `optimum-flatten layer-collapse` runs all three steps."
        )
    check_not_gated(adapter, sorted(prepared), stack)
    if config.selects:
        selected = config.selected_indices(adapter.num_layers(stack), collapsed_mlp_indices(adapter, stack))
        if sorted(prepared) != selected:
            raise ValueError(
                f"the config selects the MLPs of layers {selected}, but the prepared ones are {sorted(prepared)}; "
                "the collapse step collapses the prepared MLPs, so pass the same num_mlps / mlp_fraction as for "
                "prepare_layer_collapse_, or none."
            )
    return dict(sorted(prepared.items()))


@torch.no_grad()
def collapse_prepared_mlps_(
    model: nn.Module,
    *,
    threshold: float = 1e-4,
    batches: Sequence[CalibrationBatch] | None = None,
    stack: str | None = None,
) -> list[dict[str, Any]]:
    """Step 3 without the quantizer: collapses every prepared MLP into one linear map, in place.

    Every α is checked before anything changes; one MLP with ``|1 − α| ≥ threshold`` refuses the whole call.

    Args:
        model: A model prepared with `prepare_layer_collapse_` and trained.
        threshold: Collapse when ``|1 − α| < threshold``.
        batches: Calibration batches; when given, each record also holds the error bound and measured error.
        stack: The block stack (None: the model's only stack).

    Returns:
        One record per collapsed MLP: layer, α, parameter counts, and the errors when measured.

    Raises:
        NotCollapsibleError: an α is above the threshold (the message states it); nothing is changed.
        ValueError: nothing is prepared.
    """
    config = LayerCollapseConfig(threshold=threshold)
    adapter = get_adapter(model)
    stack = single_stack(adapter, stack)
    targets = _collapse_targets(adapter, stack, config)
    require_all_ready(targets, threshold)
    errors = {}
    if batches:
        errors = measure_collapse_errors(adapter, stack, sorted(targets), LayerwiseRunner(adapter, batches, stack))
    return _collapse_record(adapter, stack, sorted(targets), threshold, errors)


def _card_summary(report: Mapping[str, Any]) -> str | None:
    """The card's opening paragraph for the format the export wrote; None (the generic one) for any other."""
    architecture = report.get("architecture", "transformers")
    if report.get("export_format") == "remote_code":
        # Per-layer MLP shapes: the modelling file beside the weights subclasses the stock class.
        return (
            f"This checkpoint is `{architecture}` with some MLPs collapsed into one linear map (or carrying a learned "
            "linearity alpha), which no stock config can describe. The modelling file in this directory (listed in "
            "config.json's `auto_map`) subclasses the stock class; load it with `trust_remote_code=True`. It needs "
            "torch and transformers only, not optimum-flatten."
        )
    if report.get("export_format") == "stock":
        return (
            f"This is an ordinary `{architecture}` checkpoint whose MLPs are each one linear map (LayerCollapse), "
            "stored as an MLP of width = hidden size with a linear activation and an identity down map. It loads "
            "with plain `transformers`; optimum-flatten is not needed."
        )
    return None


def _stock_parameters(report: Mapping[str, Any]) -> str | None:
    """The card's parameter count for a stock checkpoint, which holds an identity down map per MLP that the model in
    memory does not (``parameters_after``); None (the generic count) for any other format."""
    before, after = report.get("parameters_before"), report.get("parameters_after")
    added = report.get("stock_identity_parameters")
    if report.get("export_format") != "stock" or not all(isinstance(n, int) for n in (before, after, added)):
        return None
    return (
        f"{before:,} -> {after + added:,} as saved and reloaded ({after:,} in memory: the stock format adds an "
        f"identity down map to each MLP, {added:,} parameters)"
    )


# ---------------------------------------------------------------------------------------------- the method
@register_method(METHOD_NAME)
class LayerCollapseMethod(CompressionMethod):
    """The collapse step of LayerCollapse inside `FlattenQuantizer`: merges every trained, prepared MLP.

    Preparing and training are not part of `compress` (they need the user's training loop); see the module
    docstring. The plan is the identity (no layer is removed) and ``report["layer_collapse"]`` lists the collapsed
    MLPs with their α, parameter counts and, with calibration data, the error bound and measured error.
    """

    config_class = LayerCollapseConfig
    keeps_depth: ClassVar[bool] = True
    # One dense up -> activation -> down MLP per layer is what collapses; experts behind a router never do.
    required_capabilities = frozenset({"dense_mlp"})
    # Collapsed MLPs have per-layer shapes that model.save_pretrained cannot describe; and LayerCollapse needs a
    # training run between loading and collapsing anyway.
    supports_compress_on_load: ClassVar[bool] = False
    compress_on_load_refusal: ClassVar[str] = (
        "it collapses MLPs whose alpha a training run brought to 1, and the result needs optimum-flatten's export "
        "(model.save_pretrained would write a config that does not describe it). Load the model, train it "
        "(prepare_layer_collapse_, build_layer_collapse_trainer), then FlattenQuantizer(config).compress(model, "
        "tokenizer) and FlattenQuantizer.save(model, path)."
    )
    #: The remote-code modelling file that `write_layer_collapse_model` adds (`remote_code`).
    checkpoint_files: ClassVar[tuple[str, ...]] = ("modeling_layer_collapse_*.py",)
    config: LayerCollapseConfig

    # ------------------------------------------------------------------------------------- lifecycle hooks
    @classmethod
    def checkpoint_writer(cls, model: nn.Module) -> CheckpointWriter | None:
        """The LayerCollapse writer, with the MLP layout for the report, when any MLP of any stack is collapsed or
        still carries an α (whichever method's report is saved: the state is in the model); else None."""
        # Asked of every model a save writes: a family with no adapter or without dense MLPs holds nothing of ours.
        try:
            adapter = get_adapter(model)
        except UnsupportedArchitectureError:
            return None
        if adapter.missing_capabilities(cls.required_capabilities):
            return None
        layout = {}
        for stack in adapter.stacks():
            collapsed, linearisable = collapsed_mlp_indices(adapter, stack), sorted(prepared_mlps(adapter, stack))
            layout[stack] = {"collapsed": collapsed, "linearisable": linearisable}
        if not any(entry["collapsed"] or entry["linearisable"] for entry in layout.values()):
            return None
        report: dict[str, Any] = {"mlp_layout": layout}
        if stock_format_problem(model) is None:  # the card counts what a stock checkpoint holds (`card_section`)
            report["stock_identity_parameters"] = stock_identity_parameters(model)
        return CheckpointWriter(function=write_layer_collapse_model, report=report)

    @classmethod
    def adopt_reloaded_(cls, model: nn.Module) -> list[str]:
        """Turns the α activations of a model reloaded from this method's remote-code checkpoint back into
        `ParametricActivation`s (see `reload`), so that training, the collapse and the export see them."""
        return adopt_reloaded_(model)

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """Which MLPs are one linear map (from ``mlp_layout``), which the CLI trained (its ``training`` record), how
        the written format loads (``export_format``) and, for the stock format, the parameters it holds."""
        layouts = report.get("mlp_layout") or {}
        if not layouts:
            return None
        lines = tuple(
            f"- {stack}: MLPs collapsed into one linear map in layers {layout['collapsed']}"
            + (f", learned linearity alpha still in layers {layout['linearisable']}" if layout["linearisable"] else "")
            for stack, layout in layouts.items()
        )
        training = report.get("training") or {}
        if training.get("selection"):  # the collapse step takes every trained MLP; the selection was the training's
            selection = ", ".join(f"{key}={value}" for key, value in training["selection"].items())
            prepared = training["prepared"]
            lines += (f"- Trained to linear before the collapse: the MLPs of layers {prepared} ({selection})",)
        return CardSection(summary=_card_summary(report), lines=lines, parameters=_stock_parameters(report))

    def __init__(self, config: LayerCollapseConfig) -> None:
        super().__init__(config)
        # The quantizer reads this on the instance: calibration data is needed only to measure the error.
        self.requires_calibration = config.measure_error
        self._targets: list[int] | None = None
        self._errors: dict[int, dict[str, float]] = {}

    @torch.no_grad()
    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        """Checks every prepared MLP is ready and measures the collapse errors; touches no weight."""
        if num_to_remove != 0:
            raise ValueError(f"layer_collapse keeps every layer; it cannot remove {num_to_remove}.")
        stack = context.stack
        targets = _collapse_targets(adapter, stack, self.config)
        require_all_ready(targets, self.config.threshold)
        indices = sorted(targets)
        self._errors = {}
        if self.config.measure_error and context.batches:
            with context.timer("measure_error"):
                self._errors = measure_collapse_errors(adapter, stack, indices, context.new_runner(adapter))
        self._targets = indices
        logger.info("layer_collapse: collapsing the MLPs of layers %s", indices)
        num_layers = adapter.num_layers(stack)
        return LayerPlan.from_kept(num_layers, range(num_layers), stack=stack)

    @torch.no_grad()
    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        """Replaces each target MLP's two maps by their product, through the adapter."""
        if self._targets is None:
            raise RuntimeError("layer_collapse.apply_ needs the MLPs chosen by plan(); call plan() first.")
        if plan.group_lists() != [[i] for i in range(plan.num_layers)]:
            raise ValueError(f"layer_collapse keeps every layer, but got the plan {plan.describe()}.")
        records = _collapse_record(adapter, plan.stack, self._targets, self.config.threshold, self._errors)
        context.report[REPORT_KEY] = {
            "stack": plan.stack,
            "threshold": self.config.threshold,
            "collapsed": records,
            "collapsed_layers": collapsed_mlp_indices(adapter, plan.stack),
        }


__all__ = [
    "REPORT_KEY",
    "LayerCollapseMethod",
    "collapse_linearised_pair",
    "collapse_prepared_mlps_",
    "collapse_ready",
    "measure_collapse_errors",
    "require_all_ready",
    "require_collapse_ready",
]
