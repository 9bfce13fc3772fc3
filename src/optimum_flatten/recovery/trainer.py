"""Healing a compressed model with transformers' Trainer: LoRA or full-parameter training of a chosen part, on the
LM loss or distilled from the dense model (or, mode 'local', each changed span alone against the teacher's states:
`recovery.local`), behind a held-out gate, returned as a plain model.

`recover` is a sequence of steps, each in a module named after it: the mode (`mode`), the text and rows (`rows`),
the Trainer's arguments and budget (`arguments`), what changed and the layer map (`objectives`), the teacher
(`teacher`), the losses and what is trained (`objectives`), the phases behind the gate (`phases`, `gate`) and the
record (`record`). Every refusal comes before any weight changes; a new mode, text or loss registers in its step's
module (see their docstrings), not here.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..options.recovery import RecoveryConfig
from ..utils.torch_utils import keeping_use_cache
from .arguments import check_fsdp, check_in_memory, fsdp_version, healing_schedule
from .heal_request import check_healable
from .healing_run import HealingRun
from .mode import resolve_mode
from .objectives import healing_objectives, hidden_state_ends, local_spans
from .phases import note_sharding_, run_phases
from .precision import precision_notes, trained_dtypes
from .rate import weight_scale
from .record import healing_log, heldout_parts
from .resume import check_started_options, healing_identity
from .rows import _teacher_rows, check_recovery_inputs, checked_share, read_rows, unguarded_notes
from .teacher import _has_teacher, checked_teacher

# Importable from here as before the steps had modules of their own (`quantizer`, tests, other branches).
__all__ = ["RecoveryConfig", "_teacher_rows", "check_fsdp", "check_recovery_inputs", "fsdp_version", "recover"]

logger = logging.getLogger(__name__)


def recover(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    config: RecoveryConfig | None = None,
    text_column: str = "text",
    teacher: Any = None,
    report: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Heals `model` on `dataset` and returns (plain model, training log).

    Every check (mode, teacher vocabulary and tokenizer, layer map, text for the budget) runs before any weight
    changes. With a teacher the loss is the distillation loss of `recovery.distill`; without one, the LM loss. Mode
    'local' trains on `recovery.local`'s per-span loss instead, behind a gate scoring the distillation loss.

    Args:
        model: The compressed causal LM (changed in place, except that LoRA is merged into a returned model).
        tokenizer: Its tokenizer.
        dataset: Training text (see `load_recovery_texts`); the gate's held-out rows are drawn from it.
        config: What to train and how (`RecoveryConfig`).
        text_column: Column of a `datasets` dataset holding the text.
        teacher: The dense model: a loaded model, a checkpoint folder, a bundled name (``"smollm2"``) or a Hub id.
            None takes the report's base model when it is a bundled model or a Hub id (else no teacher); False or
            ``"none"`` trains on the LM loss alone.
        report: The compression report (``FlattenQuantizer.report`` or flatten_report.json); defaults to
            ``model.flatten_report`` when set. Needed by modes 'changed' and 'local', hidden-state terms and the
            default teacher.

    Returns:
        The model (LoRA merged) and a log: mode, teacher, rows, tokens trained, steps, processes, FSDP (2 when the
        Trainer sharded the model, else None), the learning rate and the weight scale its default follows
        (`RecoveryConfig.rate_for`), the held-out objective and LM loss before and after, and the gate's
        decision. Under FSDP2 the model comes back as the Trainer left it, sharded in place (its parameters are
        DTensors): call `recovery.unsharded.unsharded_for_save` on every process and save what rank 0 gets back.

    Raises:
        ValueError: an unknown mode, a teacher with another vocabulary or tokenizer, hidden-state terms without a
            layer map, too little text for the budget, 'changed' or 'local' with nothing changed, 'local' without a
            teacher or under a data-parallel launch, FSDP1, 'local' or 'lora' under FSDP (`check_fsdp`).
        ImportError: when peft is missing for mode='lora' (``pip install optimum-flatten[recovery]``).
    """
    from ..utils.launch import is_writer

    check_in_memory(model)
    config, report, choice = resolve_mode(model, dataset, config or RecoveryConfig(), teacher, report)
    check_started_options(config)  # before any row is read or sampled into its checkpoint_dir
    check_healable(model, config, model.config.get_text_config().num_hidden_layers)
    share = checked_share(dataset, config, _has_teacher(teacher, report))
    scale = weight_scale(model)  # before any wrapper: every process reads the same weights, so the same rate
    rows = read_rows(tokenizer, dataset, config, text_column, share)
    # The arguments come first: building them joins the processes of a distributed launch, and the budget's steps
    # depend on how many there are (`_replicas`); so a budget the text cannot fill is refused before any change.
    # The scratch folder is removed after training, or by its finalizer when a check below refuses.
    scratch_dir = tempfile.TemporaryDirectory()
    schedule = healing_schedule(config, scale, scratch_dir.name)
    rows.plan_(config, schedule.replicas)
    schedule.budget_(config, rows.planned)
    spans = local_spans(model, report, config, schedule, teacher, rows.planned)
    ends = hidden_state_ends(model, report, config)
    dense, name, notes = checked_teacher(model, tokenizer, teacher, report, config, rows.texts, rows.plan is not None)
    weights = _weights_before(model, dense, config)  # before LoRA or a local span wraps the student
    objectives = healing_objectives(model, dense, config, report, spans, ends, notes)
    notes += unguarded_notes(config, share) + precision_notes(model, config, schedule.arguments.learning_rate, scale)
    for note in notes if is_writer() else ():
        logger.info(note)
    run = HealingRun(config, choice, scale, rows, schedule, spans, name, dense is not None, notes, objectives)
    with scratch_dir, keeping_use_cache(model):  # the Trainer sets it to False
        if dense is not None:
            dense.to(schedule.arguments.device)
        # Its sampling bar is hidden as the Trainer's are (`--no-progress` sets disable_tqdm): an explicit
        # progress=True would override TQDM_DISABLE too.
        shown = is_writer() and not config.extra_training_args.get("disable_tqdm", False)
        rows.add_teacher_part_(dense, tokenizer, config, shown)
        if weights is not None:
            processes, dtype = schedule.arguments.world_size, ",".join(sorted(trained_dtypes(model)))
            run.identity = healing_identity(*weights, rows.train, [*rows.heldout, *rows.guard], processes, dtype)
        device = schedule.arguments.device
        parts_before = rows.part_scores(objectives.trained, objectives.healing_loss, config, device)
        phases, local_scores = run_phases(run)
    note_sharding_(run, phases[0])
    trained_model = objectives.release_()
    parts_after = rows.part_scores(trained_model, objectives.healing_loss, config)
    log = healing_log(run, phases, local_scores, heldout_parts(rows, parts_before, parts_after))
    if phases[0].gate is not None and is_writer():
        before, after = phases[0].gate.start["objective"], log["heldout_after"]["objective"]
        logger.info("gate: %s (held-out objective %.4f -> %.4f)", log["gate"], before, after)
    return trained_model, log


def _weights_before(
    model: nn.Module, teacher: nn.Module | None, config: RecoveryConfig
) -> tuple[str, str | None] | None:
    """The student's and the teacher's weights fingerprints before training, which a checkpoint folder records as
    its job (`resume.healing_identity`); None without a folder."""
    if not config.checkpoint_dir:
        return None
    from ..utils.fingerprint import weights_fingerprint

    return weights_fingerprint(model), weights_fingerprint(teacher) if teacher is not None else None
