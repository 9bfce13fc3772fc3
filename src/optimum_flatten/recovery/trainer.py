"""Healing a compressed model with transformers' Trainer: LoRA or full-parameter training of a chosen part, on the
LM loss or distilled from the dense model (or, mode 'local', each changed span alone against the teacher's states:
`recovery.local`), behind a held-out gate, returned as a plain model."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig, merges_layers, with_mode
from ..utils.launch import join_launcher_group
from ..utils.positions import check_sequence_length
from .arguments import _global_phase, _replicas, _steps_for_budget, check_fsdp, fsdp_version, training_arguments
from .distill import healing_losses
from .footprint import ModeChoice, teacher_bytes_to_load
from .phases import _score, _train_phase
from .rate import weight_scale
from .record import HealingFacts, healing_log
from .resume import (
    phase_folder,
)
from .rows import (
    _part_scores,
    _planned_rows,
    _sample_teacher_part,
    _training_text,
    teacher_share,
)
from .selection import (
    Span,
    changed_spans,
    freeze_all_but_,
    layer_map,
    trained_parameters_,
    without_embeddings,
)
from .teacher import _declines_teacher, _has_teacher, _resolve_teacher
from .teacher_text import is_teacher_dataset

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
        DTensors): gather it on every process with ``torch.distributed.checkpoint.state_dict.get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` and save from rank 0.

    Raises:
        ValueError: an unknown mode, a teacher with another vocabulary or tokenizer, hidden-state terms without a
            layer map, too little text for the budget, 'changed' or 'local' with nothing changed, 'local' without a
            teacher or under a data-parallel launch, FSDP1, 'local' or 'lora' under FSDP (`check_fsdp`).
        ImportError: when peft is missing for mode='lora' (``pip install optimum-flatten[recovery]``).
    """
    from .gate import is_main_process

    config = config or RecoveryConfig()
    if is_teacher_dataset(dataset):  # the teacher's text only: the log, the footprint and a resume see share 1
        config = dataclasses.replace(config, teacher_text=teacher_share(dataset, config))
    # A row past a position table fails inside the first step; refused here, before anything is built or changed.
    check_sequence_length(model, config.seqlen)
    # Under torchrun / accelerate launch the ranks are joined first, so that they agree on the mode (each checks its
    # own memory) before the Trainer wraps the model.
    join_launcher_group()
    if report is None:
        report = getattr(model, "flatten_report", None)
    choice = ModeChoice(model, config, lambda: teacher_bytes_to_load(model, teacher, report))
    config = with_mode(
        config,
        has_teacher=_has_teacher(teacher, report),
        has_plan=bool((report or {}).get("plan")),
        fsdp=fsdp_version(config) is not None,
        full_fits=choice,
        merged=merges_layers((report or {}).get("plan")),
    )
    config = choice.apply(config)
    share = teacher_share(dataset, config)
    if share > 0 and not _has_teacher(teacher, report):
        raise ValueError(_TEXT_NEEDS_TEACHER)
    dtype = next(model.parameters()).dtype
    scale = weight_scale(model)  # before any wrapper: every process reads the same weights, so the same rate
    texts, kind, train_rows, heldout = _training_text(tokenizer, dataset, config, text_column)
    # The arguments come first: building them joins the processes of a distributed launch, and the budget's steps
    # depend on how many there are (`_replicas`); so a budget the text cannot fill is refused before any change.
    # The scratch folder is removed after training, or by its finalizer when a check below refuses.
    scratch_dir = tempfile.TemporaryDirectory()
    arguments = training_arguments(
        config, scale, phase_folder(config, 1) if config.checkpoint_dir else scratch_dir.name
    )
    fsdp = fsdp_version(config, arguments)
    check_fsdp(config, fsdp)
    replicas = _replicas(config, arguments.world_size)
    plan, planned, train_rows = _planned_rows(config, share, train_rows, replicas)
    arguments.max_steps = _steps_for_budget(config, planned, replicas)
    spans: list[Span] = []
    global_steps = 0
    if config.mode == "local":
        if replicas > 1 or arguments.world_size > 1:
            raise ValueError(
                f"mode='local' trains on one process (its blocks run outside the model's forward, so a data-parallel "
                f"wrapper would not synchronise them), got {arguments.world_size} processes; launch it without "
                "torchrun / accelerate, or pick mode 'changed'."
            )
        if _declines_teacher(teacher):
            raise ValueError(_LOCAL_NEEDS_TEACHER)
        spans = changed_spans(model, report)  # refuses without a plan or with nothing changed, before the teacher
        if config.local_then_global_tokens:
            global_steps = _steps_for_budget(_global_phase(config), planned, replicas)
    if config.hidden_weight > 0:
        ends = layer_map(report, len(get_adapter(model).blocks()))  # refuses without a plan, before the teacher loads
    teacher_model, teacher_tokenizer, teacher_name = _resolve_teacher(teacher, report, dtype)
    if config.mode == "local" and teacher_model is None:
        raise ValueError(_LOCAL_NEEDS_TEACHER)
    if plan is not None and teacher_model is None:
        raise ValueError(_TEXT_NEEDS_TEACHER)
    if config.hidden_weight > 0 and teacher_model is None:
        raise ValueError(
            "hidden-state terms (hidden_weight > 0) need a teacher; give teacher=..., or set hidden_weight to 0."
        )
    notes: list[str] = []
    if teacher_model is not None:
        from .teacher import check_compatible, check_source

        check_compatible(model, teacher_model, tokenizer, teacher_tokenizer, texts)
        mismatch = check_source(teacher_model, report)
        notes += [mismatch] if mismatch else []
    healing_loss, local_loss = healing_losses(
        model, teacher_model, config, spans, ends if config.hidden_weight > 0 else []
    )
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    trained_model, lora = trained_parameters_(model, config, report, spans, notes)
    for note in notes if is_main_process() else ():
        logger.info(note)
    teacher_record: dict[str, Any] | None = None
    parts: dict[str, list[dict[str, torch.Tensor]]] = {}
    with scratch_dir:
        if teacher_model is not None:
            teacher_model.to(arguments.device)
        if plan is not None:
            sampled, sampled_heldout, teacher_record = _sample_teacher_part(
                teacher_model, tokenizer, config, plan, is_main_process()
            )
            if heldout and sampled_heldout:
                parts = {"user": heldout, "teacher": sampled_heldout}
            train_rows, heldout = [*train_rows, *sampled], [*heldout, *sampled_heldout]
        if parts:
            trained_model.to(arguments.device)
            parts_before = _part_scores(trained_model, healing_loss, parts, config)
        if local_loss is None:
            phase = _train_phase(trained_model, arguments, train_rows, heldout, healing_loss, healing_loss, config)
            phases = [phase]
        else:
            # The gate scores the global distillation objective, not the local one: the local loss is a proxy
            # (each span on the teacher's input), and what must never get worse is the model's own output.
            trained_model.to(arguments.device)
            local_before = _score(trained_model, local_loss, heldout, config)
            phases = [_train_phase(trained_model, arguments, train_rows, heldout, local_loss, healing_loss, config)]
            local_after = _score(trained_model, local_loss, heldout, config)
            if global_steps:
                arguments.max_steps = global_steps
                arguments.learning_rate = _global_phase(config).rate_for(scale)
                if config.global_scope == "all":
                    every = [name for name, _ in model.named_parameters()]
                    every = every if config.trains_embeddings else without_embeddings(model, every)
                    trainable = freeze_all_but_(model, every)
                    if is_main_process():
                        logger.info("global phase: training every parameter (%d)", trainable)
                phases.append(
                    _train_phase(trained_model, arguments, train_rows, heldout, healing_loss, healing_loss, config, 2)
                )
    if fsdp is not None and not phases[0].sharded:
        notes.append(_NOT_SHARDED)
        if is_main_process():
            logger.info(_NOT_SHARDED)
    if lora is not None:
        trained_model = trained_model.merge_and_unload()
    else:
        for name, parameter in trained_model.named_parameters():
            parameter.requires_grad_(flags[name])
    trained_model.eval()
    if parts:
        after = _part_scores(trained_model, healing_loss, parts, config)
        heldout_parts: dict[str, Any] = {
            name: {"rows": len(rows), "before": parts_before[name], "after": after[name]}
            for name, rows in parts.items()
        }
        heldout_parts["gate_objective"] = "the objective over both parts together"
    first = phases[0]
    log = healing_log(
        HealingFacts(
            config=config,
            choice=choice,
            teacher_name=teacher_name,
            has_teacher=teacher_model is not None,
            local=local_loss is not None,
            kind=kind,
            rows=len(train_rows),
            world_size=arguments.world_size,
            replicas=replicas,
            scale=scale,
            optimizer=str(getattr(arguments.optim, "value", arguments.optim)),
            global_learning_rate=arguments.learning_rate,
            notes=notes,
            teacher_record=teacher_record,
            heldout_parts=heldout_parts if parts else None,
            spans=spans,
            local_scores=(local_before, local_after) if local_loss is not None and heldout else None,
            lora=lora,
        ),
        phases,
    )
    if first.gate is not None and is_main_process():
        before, after = first.gate.start["objective"], log["heldout_after"]["objective"]
        logger.info("gate: %s (held-out objective %.4f -> %.4f)", log["gate"], before, after)
    return trained_model, log


_NOT_SHARDED = (
    "FSDP was asked for, but accelerate shards only on accelerators (CUDA, XPU, NPU...): this run was "
    "data-parallel (DDP), every process holding the whole model"
)

_TEXT_NEEDS_TEACHER = (
    "teacher text (dataset='teacher' or teacher_text > 0) is sampled from the teacher, and no teacher was given (or "
    "the report names none); give teacher=... (the dense model), or train on a text of your own."
)

_LOCAL_NEEDS_TEACHER = (
    "mode='local' trains each changed span towards the teacher's states, and no teacher was given (or the report "
    "names none); give teacher=... (the dense model), or pick mode 'changed', 'last_k', 'full' or 'lora'."
)
