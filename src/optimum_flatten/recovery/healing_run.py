"""What the steps of a healing settle and the later ones read (`HealingRun`): the phases train from it and the record
is written from it, so that a step added to `recover` adds a field here rather than an argument everywhere."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..options.recovery import RecoveryConfig
from .arguments import Schedule
from .footprint import ModeChoice
from .objectives import Objectives
from .rows import HealingRows
from .selection import Span


@dataclasses.dataclass
class HealingRun:
    """A healing once every check has passed and before it trains.

    Attributes:
        config: The options, mode settled (`mode.resolve_mode`).
        choice: How the mode was chosen, for the log.
        scale: The weights' scale the default learning rate follows (`rate.weight_scale`).
        rows: The training and held-out rows (`rows.HealingRows`).
        schedule: The TrainingArguments and the budget's steps (`arguments.Schedule`).
        spans: Mode 'local''s spans (none otherwise).
        teacher_name: The teacher's public name (None without one).
        has_teacher: Whether a teacher was loaded.
        notes: What the log says beside the numbers (a teacher other than the model compressed, ...).
        objectives: The losses and the trained model (`objectives.Objectives`).
        identity: The job a checkpoint folder must hold to be resumed (`resume.healing_identity`; None without a
            folder).
    """

    config: RecoveryConfig
    choice: ModeChoice
    scale: float
    rows: HealingRows
    schedule: Schedule
    spans: list[Span]
    teacher_name: str | None
    has_teacher: bool
    notes: list[str]
    objectives: Objectives
    identity: dict[str, Any] | None = None
