"""The record a healing returns (`recover`'s log, which lands in flatten_report.json and the model card): what was
trained, on what, how it was chosen and what the gate decided, in one place, so that a new mode or healing text adds
its entry here rather than inside the training steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..options.recovery import RecoveryConfig
from .footprint import ModeChoice
from .phases import _combined_decision, _Phase
from .selection import Span


@dataclass
class HealingFacts:
    """What the steps of `recover` settled, beside the phases: the inputs of `healing_log`."""

    config: RecoveryConfig
    choice: ModeChoice
    teacher_name: str | None
    has_teacher: bool
    local: bool
    kind: str
    rows: int
    world_size: int
    replicas: int
    scale: float
    optimizer: str
    global_learning_rate: float
    notes: list[str]
    teacher_record: dict[str, Any] | None
    heldout_parts: dict[str, Any] | None
    spans: list[Span]
    local_scores: tuple[Any, Any] | None
    lora: Any


def healing_log(facts: HealingFacts, phases: list[_Phase]) -> dict[str, Any]:
    """The healing's log: the first phase's training and gate, every phase's seconds and decisions, and the entries
    of a local run (its spans, its global phase), LoRA, teacher text and frozen embeddings where they apply."""
    config, first = facts.config, phases[0]
    steps = sum(p.steps for p in phases)
    log = {
        "mode": config.mode,
        "mode_chosen": facts.choice.describe(config),
        "teacher": facts.teacher_name,
        "loss": "lm" if not facts.has_teacher else ("local" if facts.local else "distillation"),
        "temperature": config.temperature if facts.has_teacher else None,
        "kd_alpha": config.kd_alpha if facts.has_teacher else None,
        "hidden_weight": config.hidden_weight,
        "state_loss": config.state_loss if facts.local or config.hidden_weight > 0 else None,
        "data_kind": facts.kind,
        "rows": facts.rows,
        "seqlen": config.seqlen,
        "rows_per_step": config.rows_per_step(),  # on each process; `tokens_trained` counts all of them
        "steps": steps,
        "processes": facts.world_size,
        "fsdp": 2 if first.sharded else None,
        "tokens_trained": steps * config.tokens_per_step() * facts.replicas,
        "train_loss": first.result.training_loss,
        "loss_history": first.history,
        "learning_rate": config.rate_for(facts.scale),  # the first phase's (a global phase after `local` has its own)
        "optimizer": facts.optimizer,  # TrainingArguments.optim
        "weight_scale": facts.scale,
        "train_seconds": sum(p.seconds for p in phases),
        # Where each phase continued from (None: from its start); the folder is not logged: reports keep no paths.
        **({"resumed_from_step": [p.resumed_from for p in phases]} if config.checkpoint_dir else {}),
        "gate": _combined_decision([p.decision for p in phases]),
        **(first.gate.summary() if first.gate is not None else {}),
        **({"notes": facts.notes} if facts.notes else {}),
        **({"teacher_text": facts.teacher_record} if facts.teacher_record is not None else {}),
        **({"heldout_parts": facts.heldout_parts} if facts.heldout_parts else {}),
        **({} if config.trains_embeddings else {"embeddings": "frozen (the token embeddings and the LM head)"}),
    }
    if facts.local:
        log.update(_local_entries(facts, phases))
    if facts.lora is not None:
        log["lora"] = {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(facts.lora.target_modules)}
    return log


def _local_entries(facts: HealingFacts, phases: list[_Phase]) -> dict[str, Any]:
    """A local run's spans and, after a global phase, that phase's record (and the held-out objective it ended on)."""
    config, last = facts.config, phases[-1]
    before_after = facts.local_scores
    entries: dict[str, Any] = {
        "local": {
            "spans": [{"block": s.block, "original_layers": [s.start, s.end - 1]} for s in facts.spans],
            "trained": "every parameter of each span's student block",
            "gate_objective": "distillation (global)",
            **(
                {"heldout_local_before": before_after[0], "heldout_local_after": before_after[1]}
                if before_after is not None
                else {}
            ),
        }
    }
    if len(phases) > 1:
        entries["global_phase"] = {
            "loss": "distillation",
            "trained": "the same blocks" if config.global_scope == "spans" else "every parameter",
            "learning_rate": facts.global_learning_rate,
            "steps": last.steps,
            "tokens_trained": last.steps * config.tokens_per_step() * facts.replicas,
            "train_loss": last.result.training_loss,
            "loss_history": last.history,
            "train_seconds": last.seconds,
            "gate": last.decision,
            **(last.gate.summary() if last.gate is not None else {}),
        }
        if last.gate is not None:
            entries["heldout_after"] = last.gate.best
    return entries
