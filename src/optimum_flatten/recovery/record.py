"""The record a healing returns (`recover`'s log, which lands in flatten_report.json and the model card): what was
trained, on what, how it was chosen and what the gate decided, in one place, so that a new mode or healing text adds
its entry here rather than inside the training steps."""

from __future__ import annotations

from typing import Any

from .healing_run import HealingRun
from .phases import _combined_decision, _Phase
from .resume import folder_bytes, phase_folders
from .rows import HealingRows


def heldout_parts(
    rows: HealingRows, before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
) -> dict[str, Any] | None:
    """Each held-out part's rows and scores before and after training (None without parts): the gate decides on
    both together, the log says how each fared."""
    if before is None or after is None:
        return None
    entry: dict[str, Any] = {
        name: {"rows": len(part), "before": before[name], "after": after[name]} for name, part in rows.parts.items()
    }
    entry["gate_objective"] = "the objective over both parts together"
    return entry


def tokens_trained(run: HealingRun, phase: _Phase) -> int:
    """The real tokens `phase` trained on, every process's (the Trainer's count of the attention mask, kept across a
    resume); a phase without that count (replayed from a record written before it was kept) gives its positions
    instead, which are the same for packed text and the teacher's rows (no padding)."""
    if phase.tokens is not None:
        return phase.tokens
    return phase.steps * run.config.tokens_per_step() * run.schedule.replicas


def healing_log(
    run: HealingRun,
    phases: list[_Phase],
    local_scores: tuple[float, float] | None,
    parts: dict[str, Any] | None,
) -> dict[str, Any]:
    """The healing's log: the first phase's training and gate, every phase's seconds and decisions, and the entries
    of a local run (its spans, its held-out span loss `local_scores`, its global phase), LoRA, teacher text, the
    held-out `parts` and frozen embeddings where they apply."""
    config, first, arguments = run.config, phases[0], run.schedule.arguments
    local, lora = run.objectives.local_loss is not None, run.objectives.lora
    steps = sum(p.steps for p in phases)
    log = {
        "mode": config.mode,
        "mode_chosen": run.choice.describe(config),
        "teacher": run.teacher_name,
        "loss": "lm" if not run.has_teacher else ("local" if local else "distillation"),
        "temperature": config.temperature if run.has_teacher else None,
        "kd_alpha": config.kd_alpha if run.has_teacher else None,
        "hidden_weight": config.hidden_weight,
        "state_loss": config.state_loss if local or config.hidden_weight > 0 else None,
        "data_kind": run.rows.kind,
        "rows": len(run.rows.train),
        "seqlen": config.seqlen,
        "rows_per_step": config.rows_per_step(),  # on each process; `positions_trained` counts all of them
        "steps": steps,
        "processes": arguments.world_size,
        "fsdp": 2 if first.sharded else None,
        # Real tokens (the attention mask's, every process's): chat and instruction rows are padded to seqlen, and
        # the padding trains nothing; `positions_trained` counts the rows' positions, padding included.
        "tokens_trained": sum(tokens_trained(run, p) for p in phases),
        "positions_trained": steps * config.tokens_per_step() * run.schedule.replicas,
        # The mean over every step of the first phase (a resumed run's earlier steps included) of the loss logged
        # at each step, itself the mean over the processes (`phases.run_loss`).
        "train_loss": first.train_loss,
        "loss_history": first.history,
        "learning_rate": config.rate_for(run.scale),  # the first phase's (a global phase after `local` has its own)
        "optimizer": str(getattr(arguments.optim, "value", arguments.optim)),  # TrainingArguments.optim
        "weight_scale": run.scale,
        "train_seconds": sum(p.seconds for p in phases),
        # Where each phase continued from (None: from its start) and the bytes the checkpoints still hold; the folder is
        # not logged: reports keep no paths.
        **(
            {
                "resumed_from_step": [p.resumed_from for p in phases],
                "checkpoint_bytes": sum(folder_bytes(f) for f in phase_folders(config.checkpoint_dir)),
            }
            if config.checkpoint_dir
            else {}
        ),
        "gate": _combined_decision([p.decision for p in phases]),
        **(first.gate.summary() if first.gate is not None else {}),
        **({"notes": run.notes} if run.notes else {}),
        **({"teacher_text": run.rows.record} if run.rows.record is not None else {}),
        **({"heldout_parts": parts} if parts else {}),
        **({} if config.trains_embeddings else {"embeddings": "frozen (the token embeddings and the LM head)"}),
    }
    if local:
        log.update(_local_entries(run, phases, local_scores))
    if lora is not None:
        log["lora"] = {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(lora.target_modules)}
    return log


def _local_entries(run: HealingRun, phases: list[_Phase], before_after: tuple[float, float] | None) -> dict[str, Any]:
    """A local run's spans and, after a global phase, that phase's record (and the held-out objective it ended on)."""
    config, last = run.config, phases[-1]
    entries: dict[str, Any] = {
        "local": {
            "spans": [{"block": s.block, "original_layers": [s.start, s.end - 1]} for s in run.spans],
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
            "learning_rate": run.schedule.arguments.learning_rate,
            "steps": last.steps,
            "tokens_trained": tokens_trained(run, last),
            "positions_trained": last.steps * config.tokens_per_step() * run.schedule.replicas,
            "train_loss": last.train_loss,
            "loss_history": last.history,
            "train_seconds": last.seconds,
            "gate": last.decision,
            **(last.gate.summary() if last.gate is not None else {}),
        }
        if last.gate is not None:
            entries["heldout_after"] = last.gate.best
    return entries
