"""LayerCollapse (Shabgahi et al., "LayerCollapse: Adaptive Compression of Neural Networks", arXiv:2311.17943):
train the activation of the last MLPs towards the identity, then merge each MLP's two linear maps into one.

Unlike the other methods, LayerCollapse needs training between its two steps, so the user flow has three parts:

1. ``prepare_layer_collapse_(model, num_mlps=2)`` replaces the activation of the last ``num_mlps`` MLP blocks (or a
   fraction ``mlp_fraction`` of them) by a `ParametricActivation` at α = 0, which changes no output. Gated MLPs
   (SwiGLU: LLaMA, Qwen2, Mistral, Baichuan) are refused: with the SiLU linearised, ``gate(x) ⊙ up(x)`` is still a
   bilinear function of x, which no single matrix computes.
2. Fine-tune with ``recovery.layer_collapse_training.build_layer_collapse_trainer`` (a `LayerCollapseTrainer` with
   the ``lc·Σ(1 − α)²`` regulariser or the decoupled `AdamLC` optimizer; both log every α).
3. ``FlattenQuantizer(FlattenConfig(method="layer_collapse", dataset=..., nsamples=...)).compress(model, tokenizer)``
   collapses every prepared MLP whose ``|1 − α| < threshold`` (default 1e-4) into one linear map ``W = W2·W1``,
   ``b = W2·b1 + b2``, after measuring the error of doing so on calibration activations. One MLP above the
   threshold refuses the whole request (`NotCollapsibleError`, stating α), before anything is changed.
   ``collapse_prepared_mlps_(model)`` is the same step without the quantizer (and calibration optional).

The method keeps every layer (``keeps_depth = True``): its plan is the identity and what it collapsed is reported in
``report["layer_collapse"]``. Saving goes through `export.checkpoint.save_compressed` (what `FlattenQuantizer.save`
calls), which picks the checkpoint format: see `export.layer_collapse`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..adapters import get_adapter
from ..calibration.capture import LayerwiseRunner, capture_module_inputs
from ..calibration.data import CalibrationBatch
from ..config import FlattenConfig, MethodConfig
from ..ops.linear_collapse import collapse_error, collapse_error_bound, collapse_linear_pair
from ..ops.parametric_activations import ParametricActivation, make_parametric_activation
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import count_parameters
from .base import CardSection, CheckpointWriter, CompressionMethod, MethodContext
from .registry import register_method

logger = logging.getLogger(__name__)

#: Report key of the per-MLP collapse record (in `FlattenQuantizer.report` and flatten_report.json).
REPORT_KEY = "layer_collapse"


# --------------------------------------------------------------------------------------------------- config
@dataclass
class LayerCollapseConfig(MethodConfig):
    """Options of LayerCollapse.

    Attributes:
        num_mlps: How many MLP blocks to linearise, counted from the last block downwards and skipping MLPs that
            are already collapsed (the paper collapses the last layers first, one at a time: they are the closest to
            linear).
        mlp_fraction: The same as a fraction of the stack's blocks, rounded to the nearest whole block (at least 1).
            Give at most one of `num_mlps` and `mlp_fraction`. `prepare_layer_collapse_` needs one; the collapse
            step (the quantizer) collapses every prepared MLP and, when one is given, checks that the prepared
            MLPs are exactly the ones it selects.
        threshold: An MLP collapses only when ``|1 − α| < threshold``.
        initial_alpha: α set by `prepare_layer_collapse_`; 0 keeps every output unchanged.
        measure_error: Measure the error bound and the actual error of each collapse on the calibration
            activations (needs calibration data in the quantizer); False collapses without data.
    """

    num_mlps: int | None = None
    mlp_fraction: float | None = None
    threshold: float = 1e-4
    initial_alpha: float = 0.0
    measure_error: bool = True

    def __post_init__(self) -> None:
        if self.num_mlps is not None and (
            not isinstance(self.num_mlps, int) or isinstance(self.num_mlps, bool) or self.num_mlps < 1
        ):
            raise ValueError(f"num_mlps must be a positive integer or None, got {self.num_mlps!r}.")
        if self.mlp_fraction is not None and (
            isinstance(self.mlp_fraction, bool)
            or not isinstance(self.mlp_fraction, (int, float))
            or not 0.0 < float(self.mlp_fraction) <= 1.0
        ):
            raise ValueError(f"mlp_fraction must be a fraction in (0, 1] or None, got {self.mlp_fraction!r}.")
        if self.num_mlps is not None and self.mlp_fraction is not None:
            raise ValueError(
                f"give at most one of num_mlps and mlp_fraction, got num_mlps={self.num_mlps!r} and "
                f"mlp_fraction={self.mlp_fraction!r}; e.g. num_mlps=2 or mlp_fraction=0.25."
            )
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(
                f"threshold must be a positive number (collapse when |1 - alpha| < it), got {self.threshold!r}."
            )
        if isinstance(self.initial_alpha, bool) or not isinstance(self.initial_alpha, (int, float)):
            raise ValueError(f"initial_alpha must be a number in [0, 1], got {self.initial_alpha!r}.")
        if not 0.0 <= float(self.initial_alpha) <= 1.0:
            raise ValueError(
                f"initial_alpha must lie in [0, 1] (0 = the pretrained activation), got {self.initial_alpha}."
            )
        if not isinstance(self.measure_error, bool):
            raise TypeError(f"measure_error must be True or False, got {self.measure_error!r}.")

    @property
    def selects(self) -> bool:
        """Whether the config names a number of MLPs (else the collapse step takes every prepared one)."""
        return self.num_mlps is not None or self.mlp_fraction is not None

    def selected_indices(self, num_layers: int, collapsed: Collection[int] = ()) -> list[int]:
        """The last `num_mlps` (or ``round(mlp_fraction · num_layers)``) blocks of a stack whose MLP is not
        `collapsed` yet, ascending.

        Skipping the collapsed MLPs makes repeated rounds walk down the stack, one MLP (or one batch) at a time, as
        the paper does: after collapsing the last MLP, ``num_mlps=1`` selects the one below it.

        Raises:
            ValueError: neither option is set, or more MLPs are asked for than the stack has left un-collapsed.
        """
        if not self.selects:
            raise ValueError(
                "say how many MLPs to linearise: num_mlps=k (the last k blocks) or mlp_fraction=f (the last "
                f"round(f x {num_layers}) blocks), got neither."
            )
        if self.num_mlps is not None:
            count, source = self.num_mlps, f"num_mlps={self.num_mlps}"
        else:
            count = max(1, math.floor(float(self.mlp_fraction) * num_layers + 0.5))
            source = f"mlp_fraction={self.mlp_fraction} of {num_layers} blocks"
        candidates = [i for i in range(num_layers) if i not in set(collapsed)]
        if count > len(candidates):
            already = f", {num_layers - len(candidates)} of them already collapsed" if collapsed else ""
            raise ValueError(
                f"cannot linearise {count} MLPs ({source}): the stack has {num_layers} blocks{already}; choose at "
                f"most {len(candidates)}."
            )
        return candidates[len(candidates) - count :]


def _as_method_config(config: LayerCollapseConfig | FlattenConfig | None, options: Mapping[str, Any]):
    if isinstance(config, FlattenConfig):
        if config.method != "layer_collapse":
            raise ValueError(f"expected a FlattenConfig with method='layer_collapse', got method={config.method!r}.")
        config = config.method_config
    if config is None:
        return LayerCollapseConfig.from_dict(dict(options))
    if not isinstance(config, LayerCollapseConfig):
        raise TypeError(f"config must be a LayerCollapseConfig or a FlattenConfig, got {type(config).__name__}.")
    if options:
        return LayerCollapseConfig.from_dict({**config.to_dict(), **options})
    return config


def _single_stack(adapter: Any, stack: str | None) -> str:
    stacks = adapter.stacks()
    if stack is None:
        if len(stacks) != 1:
            raise ValueError(f"this model has the stacks {stacks}; pass stack= to say which one to use.")
        return stacks[0]
    if stack not in stacks:
        raise ValueError(f"stack {stack!r} does not exist in this model; it has {stacks}.")
    return stack


# ------------------------------------------------------------------------------------------ reading state
def prepared_mlps(adapter: Any, stack: str) -> dict[int, ParametricActivation]:
    """Block index -> parametric activation of every MLP of `stack` that `prepare_layer_collapse_` linearised."""
    return {
        block.index: block.mlp.activation
        for block in adapter.blocks(stack)
        if isinstance(block.mlp.activation, ParametricActivation)
    }


def collapsed_mlp_indices(adapter: Any, stack: str) -> list[int]:
    """Indices of the blocks of `stack` whose MLP is already a single linear map."""
    return [block.index for block in adapter.blocks(stack) if adapter.is_mlp_collapsed(block)]


def _check_not_gated(adapter: Any, indices: Sequence[int], stack: str) -> None:
    gated = [i for i in indices if adapter.block(stack, i).mlp.gate is not None]
    if gated:
        raise UnsupportedArchitectureError(
            f"LayerCollapse cannot collapse the MLPs of layers {gated}: model_type {adapter.config.model_type!r} has "
            "gated MLPs (down(act(gate(x)) * up(x)), e.g. SwiGLU). With the activation linearised the MLP still "
            "computes down(gate(x) * up(x)), an elementwise product of two linear maps of x: a bilinear "
            "(quadratic) function that no single linear map equals. LayerCollapse supports non-gated MLPs "
            "(GPT-2, and the BERT / ViT / Marian style up -> activation -> down); use a layer-dropping or merging "
            "method on this architecture."
        )


# ---------------------------------------------------------------------------------------------- prepare
def prepare_layer_collapse_(
    model: nn.Module,
    config: LayerCollapseConfig | FlattenConfig | None = None,
    *,
    stack: str | None = None,
    **options: Any,
) -> dict[int, ParametricActivation]:
    """Step 1: makes the activation of the last MLPs learnably linear (α = `initial_alpha`, 0 by default).

    The selection counts MLPs not collapsed yet, from the last block down (`LayerCollapseConfig.selected_indices`).
    Every check (architecture, gating, activation type, selection size) runs before any activation is replaced, so a
    refused request leaves the model unchanged. MLPs that are already prepared keep their α.

    Args:
        model: A model with an architecture adapter.
        config: A `LayerCollapseConfig`, or the `FlattenConfig(method="layer_collapse", ...)` you will compress with;
            None builds one from `options`.
        stack: The block stack (None: the model's only stack).
        **options: LayerCollapseConfig fields (``num_mlps=2`` or ``mlp_fraction=0.25``; ``initial_alpha``),
            overriding `config`.

    Returns:
        Block index -> its `ParametricActivation`, ascending; α is its ``alpha`` parameter (type `CollapseAlpha`).

    Raises:
        UnsupportedArchitectureError: no adapter for the model, or the selected MLPs are gated (SwiGLU).
        TypeError: an activation LayerCollapse cannot linearise (e.g. tanh), or a wrong config type.
        ValueError: no selection, or more MLPs than the stack has left un-collapsed.
    """
    cfg = _as_method_config(config, options)
    adapter = get_adapter(model)
    stack = _single_stack(adapter, stack)
    indices = cfg.selected_indices(adapter.num_layers(stack), collapsed_mlp_indices(adapter, stack))
    _check_not_gated(adapter, indices, stack)
    planned: list[tuple[Any, ParametricActivation, bool]] = []
    for i in indices:
        block = adapter.block(stack, i)
        current = block.mlp.activation
        if isinstance(current, ParametricActivation):
            planned.append((block, current, False))
            continue
        try:
            wrapped = make_parametric_activation(current, float(cfg.initial_alpha))
        except TypeError as error:
            raise TypeError(f"layer {i}: {error}") from error
        planned.append((block, wrapped, True))
    for block, activation, is_new in planned:
        if is_new:
            reference = next(iter(block.mlp.module.parameters()), None)
            if reference is not None:  # α on the block's device, kept in float32 (see the docs on bf16)
                activation.to(device=reference.device)
            adapter.replace_mlp_activation_(block, activation)
    logger.info("layer_collapse: linearisable activations in the MLPs of layers %s", indices)
    return {block.index: activation for block, activation, _ in planned}


# ----------------------------------------------------------------------------------------------- collapse
def _not_ready(activations: Mapping[int, ParametricActivation], threshold: float) -> list[tuple[int, float]]:
    """(layer, α) of every activation with ``|1 − α| ≥ threshold``."""
    result = []
    for index, activation in activations.items():
        alpha = float(activation.current_alpha().detach())
        if not abs(1.0 - alpha) < threshold:
            result.append((index, alpha))
    return result


def require_all_ready(activations: Mapping[int, ParametricActivation], threshold: float) -> None:
    """Raises NotCollapsibleError naming every layer whose α is not within `threshold` of 1 (and its α)."""
    from ..utils.errors import NotCollapsibleError

    waiting = _not_ready(activations, threshold)
    if waiting:
        listed = ", ".join(f"layer {i}: alpha = {a:.6g} (|1 - alpha| = {abs(1.0 - a):.3g})" for i, a in waiting)
        raise NotCollapsibleError(
            f"cannot collapse: {len(waiting)} prepared MLP(s) are still nonlinear ({listed}); collapsing needs "
            f"|1 - alpha| < threshold = {threshold:g} for every prepared MLP. Nothing was changed. Train longer or "
            "with a larger lc (build_layer_collapse_trainer), or raise the threshold after checking the measured "
            "error (ops.collapse_error) on calibration data."
        )


def _mlp_maps(block: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    mlp = block.mlp
    return mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias


@torch.no_grad()
def measure_collapse_errors(
    adapter: Any, stack: str, indices: Sequence[int], runner: LayerwiseRunner
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


def _collapse_one_(adapter: Any, stack: str, index: int, threshold: float) -> dict[str, Any]:
    """Merges one prepared MLP's maps (the readiness is checked again right before the write)."""
    block = adapter.block(stack, index)
    require_all_ready({index: block.mlp.activation}, threshold)
    alpha = float(block.mlp.activation.current_alpha().detach())
    before = count_parameters(block.mlp.module)
    weight, bias = collapse_linear_pair(*_mlp_maps(block))
    adapter.collapse_mlp_(block, weight, bias)
    after = count_parameters(adapter.block(stack, index).mlp.module)
    return {"layer": index, "alpha": alpha, "parameters_before": before, "parameters_after": after}


def _collapse_record(
    adapter: Any, stack: str, indices: Sequence[int], threshold: float, errors: Mapping[int, dict[str, float]]
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


def _collapse_targets(adapter: Any, stack: str, config: LayerCollapseConfig) -> dict[int, ParametricActivation]:
    """The prepared MLPs to collapse, checked against the config's selection when it has one."""
    prepared = prepared_mlps(adapter, stack)
    if not prepared:
        raise ValueError(
            "no MLP of this model is prepared for LayerCollapse (no ParametricActivation found). Run "
            "prepare_layer_collapse_(model, num_mlps=...) and train alpha towards 1 first "
            "(recovery.layer_collapse_training.build_layer_collapse_trainer)."
        )
    _check_not_gated(adapter, sorted(prepared), stack)
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
    stack = _single_stack(adapter, stack)
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


# ---------------------------------------------------------------------------------------------- the method
@register_method("layer_collapse")
class LayerCollapseMethod(CompressionMethod):
    """The collapse step of LayerCollapse inside `FlattenQuantizer`: merges every trained, prepared MLP.

    Preparing and training are not part of `compress` (they need the user's training loop); see the module
    docstring. The plan is the identity (no layer is removed) and ``report["layer_collapse"]`` lists the collapsed
    MLPs with their α, parameter counts and, with calibration data, the error bound and measured error.
    """

    config_class = LayerCollapseConfig
    keeps_depth: ClassVar[bool] = True
    required_capabilities = frozenset()
    # Collapsed MLPs have per-layer shapes that model.save_pretrained cannot describe; and LayerCollapse needs a
    # training run between loading and collapsing anyway.
    supports_compress_on_load: ClassVar[bool] = False
    compress_on_load_refusal: ClassVar[str] = (
        "it collapses MLPs whose alpha a training run brought to 1, and the result needs optimum-flatten's export "
        "(model.save_pretrained would write a config that does not describe it). Load the model, train it "
        "(prepare_layer_collapse_, build_layer_collapse_trainer), then FlattenQuantizer(config).compress(model, "
        "tokenizer) and FlattenQuantizer.save(model, path)."
    )
    #: The writer of models with collapsed or linearisable MLPs: the stock format when the family's config can
    #: describe them, else remote code (it sits in the export layer, above methods, hence named, not imported).
    checkpoint_writer_path: ClassVar[str] = "optimum_flatten.export.layer_collapse:write_layer_collapse_model"
    #: The remote-code modelling file that writer adds (`export.layer_collapse_remote`).
    checkpoint_files: ClassVar[tuple[str, ...]] = ("modeling_layer_collapse_*.py",)
    config: LayerCollapseConfig

    # ------------------------------------------------------------------------------------- lifecycle hooks
    @classmethod
    def checkpoint_writer(cls, model: Any) -> CheckpointWriter | None:
        """The LayerCollapse writer, with the MLP layout for the report, when any MLP of any stack is collapsed or
        still carries an α (whichever method's report is saved: the state is in the model); else None."""
        adapter = get_adapter(model)
        layout = {}
        for stack in adapter.stacks():
            collapsed, linearisable = collapsed_mlp_indices(adapter, stack), sorted(prepared_mlps(adapter, stack))
            layout[stack] = {"collapsed": collapsed, "linearisable": linearisable}
        if not any(entry["collapsed"] or entry["linearisable"] for entry in layout.values()):
            return None
        return CheckpointWriter(function=cls.checkpoint_writer_path, report={"mlp_layout": layout})

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """Which MLPs are one linear map (from ``mlp_layout``) and how the written format loads (``export_format``)."""
        layouts = report.get("mlp_layout") or {}
        if not layouts:
            return None
        lines = tuple(
            f"- {stack}: MLPs collapsed into one linear map in layers {layout['collapsed']}"
            + (f", learned linearity alpha still in layers {layout['linearisable']}" if layout["linearisable"] else "")
            for stack, layout in layouts.items()
        )
        return CardSection(summary=_card_summary(report), lines=lines)

    def __init__(self, config: LayerCollapseConfig) -> None:
        super().__init__(config)
        # The quantizer reads this on the instance: calibration data is needed only to measure the error.
        self.requires_calibration = config.measure_error
        self._targets: list[int] | None = None
        self._errors: dict[int, dict[str, float]] = {}

    @torch.no_grad()
    def plan(self, adapter: Any, context: MethodContext, num_to_remove: int) -> LayerPlan:
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
    def apply_(self, adapter: Any, plan: LayerPlan, context: MethodContext) -> None:
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
    "LayerCollapseConfig",
    "LayerCollapseMethod",
    "collapse_prepared_mlps_",
    "collapsed_mlp_indices",
    "measure_collapse_errors",
    "prepare_layer_collapse_",
    "prepared_mlps",
    "require_all_ready",
]
