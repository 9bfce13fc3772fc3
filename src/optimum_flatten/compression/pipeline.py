"""One method run on one stack: plan, apply (with the optional correction at every cut), renumber, validate.

The quantizer drives it once on the user's model; `auto` drives it on copies to score candidates. Keeping the
sequence in one place means a candidate is compressed exactly as the user's model would be.
"""

from __future__ import annotations

import logging

from ..adapters.base import ArchitectureAdapter
from ..corrections.compensation import compensated_apply_, require_compensable
from ..corrections.linear_bridge import BridgeOptions, bridged_apply_, require_bridgeable
from ..options.corrections import Corrections
from ..plan import LayerPlan
from ..utils.offload import check_weights_present
from .method import CompressionMethod, MethodContext

logger = logging.getLogger(__name__)


def preflight(
    adapter: ArchitectureAdapter, method: CompressionMethod, stack: str, corrections: Corrections, weights: bool = True
) -> None:
    """Every refusal that depends on the model, before calibration and before any weight changes; `weights=False`
    for a model built on meta to be measured, not run (`estimate`)."""
    if weights:
        check_weights_present(adapter.model)
    method.preflight(adapter, stack)
    if method.reads_mlp_projections:
        require_whole_mlps(adapter, stack, method.name)
    for option, value in (
        ("linear_replacement", corrections.linear_replacement),
        ("compensation", corrections.compensation),
    ):
        if value is not None:  # both fold into the projections of the layers around a cut
            require_whole_mlps(adapter, stack, f"{option}={value!r}")
    if corrections.linear_replacement is not None:
        replacement = corrections.linear_replacement
        require_bridgeable(adapter, stack, f"linear_replacement={replacement!r}", replacement)
        if BridgeOptions(corrections.linear_replacement).stream_gain:
            require_compensable(adapter, stack)  # the gain is folded into the embeddings like a compensation
    if corrections.compensation is not None:
        require_compensable(adapter, stack)


def plan_and_apply_(
    adapter: ArchitectureAdapter,
    method: CompressionMethod,
    context: MethodContext,
    num_to_remove: int,
    corrections: Corrections,
) -> LayerPlan:
    """Plans, applies (with `corrections`), renumbers, updates the config and validates; returns the plan.

    With `context.resume` (a job's per-layer state, checked against this job by `ResumeState.open`), a plan saved
    there by an interrupted run is used instead of planning again (with the report entries its selection wrote), and
    a new plan is saved there before any weight changes; the method finds the state on the same context for its
    groups.

    Raises:
        RuntimeError: when the method plans another number of removals than asked (nothing was changed then).
    """
    stack = context.stack
    num_layers = adapter.num_layers(stack)
    context.compensation = corrections.compensation
    resume = context.resume
    saved = resume.plan if resume is not None else None
    if saved is not None:
        plan = saved
        context.report.update(resume.plan_report)
        logger.info("%s plan resumed from %s", method.name, resume.directory)
    else:
        with context.timer("plan"):
            plan = method.plan(adapter, context, num_to_remove)
    if plan.num_layers != num_layers or plan.num_removed != num_to_remove:
        raise RuntimeError(
            f"method {method.name!r} planned {plan.describe()} for a stack of {num_layers} layers, but "
            f"{num_to_remove} must be removed; this is a bug in the method, the model was not changed."
        )
    logger.info("%s plan: %s", method.name, plan.describe())
    # A merge of layers the config describes differently (sliding/full attention, dense/sparse MLP) is refused here,
    # after planning and before any weight changes.
    adapter.check_plan_config(stack, plan.group_lists())
    if resume is not None and saved is None:
        resume.save_plan(plan, context.report)

    with context.timer("apply"):
        apply_with_corrections_(adapter, method, plan, context, corrections)
    with context.timer("export_prep"):
        adapter.reindex_(stack)
        adapter.update_config_(stack, plan.first_indices)
        if getattr(adapter.model, "hf_device_map", None):  # transformers' placement record, by module name
            device_map = adapter.model.hf_device_map
            adapter.model.hf_device_map = adapter.renumber_module_keys(device_map, stack, plan.first_indices)
        adapter.validate()
    return plan


def apply_with_corrections_(
    adapter: ArchitectureAdapter,
    method: CompressionMethod,
    plan: LayerPlan,
    context: MethodContext,
    corrections: Corrections,
) -> None:
    """``method.apply_`` with the requested correction measured before and folded after it (report filled)."""

    def apply() -> None:
        method.apply_(adapter, plan, context)

    if corrections.compensation is not None:
        context.report["compensation"] = compensated_apply_(
            adapter, plan, context, apply, scales=context.measured_scales
        )
    elif corrections.linear_replacement is not None:
        options = BridgeOptions(corrections.linear_replacement)
        context.report["linear_replacement"] = bridged_apply_(
            adapter, plan, context, options, apply, seed=corrections.seed
        )
    else:
        apply()


def require_whole_mlps(adapter: ArchitectureAdapter, stack: str, what: str) -> None:
    """Refuses a stack holding an MLP stored as one linear map (LayerCollapse's, `MlpView.is_single_map`) for a
    method or correction (`what`) that reads or folds into the up and down projections, naming the layers: found
    at its fold, after the plan was applied, it failed with the model half changed."""
    if adapter.missing_capabilities({"dense_mlp"}):  # a mixture of experts, which LayerCollapse never collapses
        return
    collapsed = [block.index for block in adapter.blocks(stack) if block.mlp.is_single_map]
    if collapsed:
        raise ValueError(
            f"{what} reads each MLP's up and down projections, and the MLPs of layers {collapsed} are single linear "
            f"maps (LayerCollapse collapsed them); run it before LayerCollapse, or remove layers from this model "
            "with a layer drop (shortgpt, sleb) and no correction."
        )
