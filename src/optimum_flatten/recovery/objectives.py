"""What a healing trains and towards what: mode 'local''s spans, the hidden-state terms' layer map, the healing
losses and the trainable parameters (or LoRA adapters). The refusals that need only the model and the report run
here before the teacher loads (`local_spans`, `hidden_state_ends`); the rest once it has (`healing_objectives`).

A new mode is one entry in `selection.MODES` and its branch in `selection.trained_parameters_` (what it trains); a
new loss is built in `healing_losses`, and a phase trains on it through `Objectives`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sized
from typing import Any

from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig
from .arguments import Schedule, _global_phase, _steps_for_budget, warn_rounded_budget
from .distill import DistillationLoss, Objective
from .selection import Span, changed_spans, layer_map, trained_parameters_
from .teacher import _LOCAL_NEEDS_TEACHER, _declines_teacher

logger = logging.getLogger(__name__)


def local_needs_one_process(processes: int) -> str:
    """Why mode 'local' refuses a launch of several processes (`local_spans`; `FlattenQuantizer.preflight` says it
    before the compression)."""
    return (
        "mode='local' trains on one process (its blocks run outside the model's forward, so a data-parallel wrapper "
        f"would not synchronise them), got {processes} processes; launch it without torchrun / accelerate, or pick "
        "mode 'changed'."
    )


def local_spans(
    model: nn.Module,
    report: Mapping[str, Any] | None,
    config: RecoveryConfig,
    schedule: Schedule,
    teacher: Any,
    planned: Sized,
) -> list[Span]:
    """Mode 'local''s spans (none for the other modes), and its global phase's steps set on `schedule`.

    Refuses, in this order, a data-parallel launch (the spans' blocks run outside the model's forward, so a wrapper
    would not synchronise them), a declined teacher, a report with no plan or nothing changed, and a global phase's
    budget the text cannot fill."""
    if config.mode != "local":
        return []
    if schedule.replicas > 1 or schedule.arguments.world_size > 1:
        raise ValueError(local_needs_one_process(schedule.arguments.world_size))
    if _declines_teacher(teacher):
        raise ValueError(_LOCAL_NEEDS_TEACHER)
    spans = changed_spans(model, report)  # refuses without a plan or with nothing changed, before the teacher
    if config.local_then_global_tokens:
        schedule.global_steps = _steps_for_budget(_global_phase(config), planned, schedule.replicas)
        warn_rounded_budget(_global_phase(config), schedule.global_steps, schedule.replicas)
    return spans


def hidden_state_ends(model: nn.Module, report: Mapping[str, Any] | None, config: RecoveryConfig) -> list[int]:
    """The original layer each student block stands for, which hidden-state terms compare (none without them);
    refuses a report without a plan, before the teacher loads."""
    if config.hidden_weight <= 0:
        return []
    return layer_map(report, len(get_adapter(model).blocks()))


@dataclasses.dataclass
class Objectives:
    """What the phases train and score: the model the Trainer trains (LoRA-wrapped for mode 'lora'), the loss the
    gate scores, mode 'local''s span loss (None otherwise), the LoRA config (None otherwise) and each parameter's
    `requires_grad` before training, restored after it (`release_`)."""

    trained: nn.Module
    healing_loss: DistillationLoss
    local_loss: Objective | None
    lora: Any
    flags: dict[str, bool]

    def release_(self) -> nn.Module:
        """The plain model after training: LoRA merged into its weights, or each parameter's `requires_grad` as it
        was; in eval mode."""
        model = self.trained
        if self.lora is not None:
            model = model.merge_and_unload()
        else:
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(self.flags[name])
        model.eval()
        return model


def healing_objectives(
    model: nn.Module,
    teacher: nn.Module | None,
    config: RecoveryConfig,
    report: Mapping[str, Any] | None,
    spans: list[Span],
    ends: list[int],
    notes: list[str],
) -> Objectives:
    """The losses (`healing_losses`), then the trainable parameters (`selection.trained_parameters_`); notes for
    the log are appended to `notes`."""
    healing_loss, local_loss = healing_losses(model, teacher, config, spans, ends)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    trained, lora = trained_parameters_(model, config, report, spans, notes)
    return Objectives(trained, healing_loss, local_loss, lora, flags)


def healing_losses(
    student: nn.Module, teacher: nn.Module | None, config: RecoveryConfig, spans: list[Span], ends: list[int]
) -> tuple[DistillationLoss, Objective | None]:
    """(the distillation loss the gate scores, mode 'local''s span loss or None): the KL to `teacher` (the LM loss
    without one), with hidden-state terms at the original layers `ends` each student block stands for.

    Raises:
        ValueError: `ends` reaches past the teacher's blocks (another dense model than the one compressed), or
            (mode 'local') the teacher is shallower than a span.
    """
    student_blocks: list[nn.Module] = []
    teacher_blocks: list[nn.Module] = []
    if config.hidden_weight > 0:
        student_blocks = [b.module for b in get_adapter(student).blocks()]
        originals = get_adapter(teacher).blocks()
        if max(ends) >= len(originals):
            raise ValueError(
                f"the report's plan reaches original layer {max(ends)} but the teacher has {len(originals)} blocks; "
                "give the dense model the checkpoint was compressed from."
            )
        teacher_blocks = [originals[e].module for e in ends]
    healing_loss = DistillationLoss(
        teacher=teacher,
        temperature=config.temperature,
        kd_alpha=config.kd_alpha,
        hidden_weight=config.hidden_weight,
        student_blocks=student_blocks,
        teacher_blocks=teacher_blocks,
        chunk_size=config.chunk_size,
        state_loss=config.state_loss,
    )
    if config.mode != "local":
        return healing_loss, None
    from .local import LocalSpanLoss

    return healing_loss, LocalSpanLoss(student, teacher, spans, config.state_loss)  # refuses a shallower teacher
