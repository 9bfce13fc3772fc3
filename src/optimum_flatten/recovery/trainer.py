"""Healing a compressed model with transformers' Trainer: LoRA or full-parameter training of a chosen part, on the
LM loss or distilled from the dense model, behind a held-out gate, returned as a plain model."""

from __future__ import annotations

import logging
import math
import os
import random
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig
from ..utils.errors import CalibrationDataError
from .data import build_training_rows, load_recovery_texts
from .distill import DistillationLoss
from .selection import (
    changed_parameter_names,
    check_mode,
    freeze_all_but_,
    last_k_parameter_names,
    layer_map,
)

logger = logging.getLogger(__name__)


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in the first block."""
    adapter = get_adapter(model)
    block = adapter.blocks()[0]
    views = [block.attention.q, block.attention.k, block.attention.v, block.attention.o, block.mlp.up, block.mlp.down]
    if block.mlp.gate is not None:
        views.append(block.mlp.gate)
    wanted = {id(v.module) for v in views}
    names = {name.split(".")[-1] for name, module in block.module.named_modules() if id(module) in wanted}
    return sorted(names)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def _distillation_trainer_class() -> type:
    """A Trainer whose `compute_loss` is the healing loss (built lazily: importing this module imports no Trainer)."""
    from transformers import Trainer

    class DistillationTrainer(Trainer):
        """transformers' Trainer with the healing loss; everything else (optimiser, schedule, devices) is the
        library's."""

        def __init__(self, *args: Any, healing_loss: DistillationLoss, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.healing_loss = healing_loss
            # Our loss is a mean over the batch's scored tokens, not a sum the Trainer normalises by the items in
            # the accumulated batch; so the Trainer divides it by the accumulation steps itself.
            self.model_accepts_loss_kwargs = False

        def compute_loss(
            self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False, **_: Any
        ) -> Any:
            parts = self.healing_loss(model, inputs)
            return (parts.total, None) if return_outputs else parts.total

    return DistillationTrainer


def _split_rows(
    rows: list[dict[str, torch.Tensor]], heldout: int, seed: int
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(training rows, held-out rows): `heldout` rows drawn with the seed, disjoint from the rest."""
    if heldout < 0:
        raise ValueError(f"heldout_rows must be at least 0, got {heldout}.")
    if heldout and heldout >= len(rows):
        raise CalibrationDataError(
            f"the recovery text gives {len(rows)} rows, not enough to hold out {heldout} and train on the rest; "
            "give more text or lower heldout_rows."
        )
    chosen = set(random.Random(seed + 1).sample(range(len(rows)), heldout))
    return [r for i, r in enumerate(rows) if i not in chosen], [r for i, r in enumerate(rows) if i in chosen]


def _split_batches(config: RecoveryConfig) -> bool:
    """Whether `extra_training_args` asks accelerate to split each batch across the processes (``accelerator_config=
    {"split_batches": True}``): then the batch size is the global one, else it is per process."""
    accelerator = config.extra_training_args.get("accelerator_config")
    if isinstance(accelerator, Mapping):
        return bool(accelerator.get("split_batches", False))
    return bool(getattr(accelerator, "split_batches", False))


def _replicas(config: RecoveryConfig, world_size: int | None = None) -> int:
    """How many per-process batches one optimiser step reads: the processes of a data-parallel launch
    (``torchrun`` / ``accelerate launch``), or 1 when accelerate splits one batch across them.

    The token budget is global (what the model trains on, all processes together), so that the same `max_tokens`
    trains the same rows under any launch. `world_size` is the Trainer's when known; before it exists (the checks
    `FlattenConfig(heal=...)` runs before compressing) the launchers' ``WORLD_SIZE`` stands for it.
    """
    if _split_batches(config):
        return 1
    return world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))


def _steps_for_budget(config: RecoveryConfig, rows: list[dict[str, torch.Tensor]], replicas: int = 1) -> int:
    """max_steps for the (global) token budget, one step reading `replicas` per-process batches; refuses a budget
    the training rows cannot fill."""
    if config.max_tokens is None:
        return config.max_steps
    if config.max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive token budget, got {config.max_tokens}.")
    per_step = config.tokens_per_step() * replicas
    steps = math.ceil(config.max_tokens / per_step)
    available = len(rows) * config.seqlen
    if steps * per_step > available:
        raise CalibrationDataError(
            f"max_tokens={config.max_tokens} needs {steps} steps of {per_step} tokens, but the "
            f"training text holds {len(rows)} rows of {config.seqlen} ({available} tokens) after holding out the "
            "gate's rows; give more text or lower max_tokens."
        )
    return steps


def _training_text(
    tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str
) -> tuple[list[str], str, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(texts, their kind, training rows, held-out rows), after the checks that need no model: the mode and, for
    LoRA, that peft is installed."""
    check_mode(config.mode)
    if config.mode == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise ImportError("healing with mode='lora' needs peft: pip install optimum-flatten[recovery]") from error
    texts, kind = load_recovery_texts(dataset, text_column)
    rows = build_training_rows(tokenizer, texts, kind, config.seqlen, config.max_samples, config.seed)
    return (texts, kind, *_split_rows(rows, config.heldout_rows, config.seed))


def check_recovery_inputs(tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str = "text") -> None:
    """The checks of `recover` that need no model: the mode, peft for LoRA, the text and the token budget.

    `FlattenConfig(heal=...)` runs them before the compression touches a weight, so that a heal that cannot run
    is refused while the model is still the dense one.
    """
    _, _, train_rows, _ = _training_text(tokenizer, dataset, config, text_column)
    _steps_for_budget(config, train_rows, _replicas(config))


def _resolve_teacher(
    teacher: Any, report: Mapping[str, Any] | None, dtype: torch.dtype
) -> tuple[nn.Module | None, Any | None, str | None]:
    """(teacher model, its tokenizer, its public name), or Nones for the LM loss alone."""
    from .gate import is_main_process
    from .teacher import default_teacher, load_teacher

    if teacher is False or (isinstance(teacher, str) and teacher.lower() == "none"):
        return None, None, None
    if teacher is None:
        teacher = default_teacher(report)
        if teacher is None:
            return None, None, None
        if is_main_process():
            logger.info("teacher: %s (the report's base model)", teacher)
    return load_teacher(teacher, dtype)


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
    changes. With a teacher the loss is the distillation loss of `recovery.distill`; without one, the LM loss.

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
            ``model.flatten_report`` when set. Needed by mode='changed', hidden-state terms and the default teacher.

    Returns:
        The model (LoRA merged) and a log: mode, teacher, rows, tokens trained, steps, the held-out objective and
        LM loss before and after, and the gate's decision.

    Raises:
        ValueError: an unknown mode, a teacher with another vocabulary or tokenizer, hidden-state terms without a
            layer map, too little text for the budget, or 'changed' with nothing changed.
        ImportError: when peft is missing for mode='lora' (``pip install optimum-flatten[recovery]``).
    """
    from transformers import TrainingArguments

    from .gate import is_main_process

    config = config or RecoveryConfig()
    if report is None:
        report = getattr(model, "flatten_report", None)
    dtype = next(model.parameters()).dtype
    texts, kind, train_rows, heldout = _training_text(tokenizer, dataset, config, text_column)
    # The arguments come first: building them joins the processes of a distributed launch, and the budget's steps
    # depend on how many there are (`_replicas`); so a budget the text cannot fill is refused before any change.
    # The scratch folder is removed after training, or by its finalizer when a check below refuses.
    scratch_dir = tempfile.TemporaryDirectory()
    arguments = TrainingArguments(
        output_dir=scratch_dir.name,
        learning_rate=config.learning_rate,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        logging_steps=config.logging_steps,
        save_strategy="no",
        report_to=[],
        seed=config.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        **config.extra_training_args,
    )
    replicas = _replicas(config, arguments.world_size)
    arguments.max_steps = _steps_for_budget(config, train_rows, replicas)
    if config.hidden_weight > 0:
        ends = layer_map(report, len(get_adapter(model).blocks()))  # refuses without a plan, before the teacher loads
    teacher_model, teacher_tokenizer, teacher_name = _resolve_teacher(teacher, report, dtype)
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
    student_blocks: list[nn.Module] = []
    teacher_blocks: list[nn.Module] = []
    if config.hidden_weight > 0:
        student_blocks = [b.module for b in get_adapter(model).blocks()]
        originals = get_adapter(teacher_model).blocks()
        if max(ends) >= len(originals):
            raise ValueError(
                f"the report's plan reaches original layer {max(ends)} but the teacher has {len(originals)} blocks; "
                "give the dense model the checkpoint was compressed from."
            )
        teacher_blocks = [originals[e].module for e in ends]
    healing_loss = DistillationLoss(
        teacher=teacher_model,
        temperature=config.temperature,
        kd_alpha=config.kd_alpha,
        hidden_weight=config.hidden_weight,
        student_blocks=student_blocks,
        teacher_blocks=teacher_blocks,
        chunk_size=config.chunk_size,
    )
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    if config.mode == "lora":
        trained_model, lora = _wrap_lora(model, config)
    else:
        if config.mode == "changed":
            names = changed_parameter_names(model, report)
        elif config.mode == "last_k":
            names, note = last_k_parameter_names(model, config.last_k)
            notes += [note] if note else []
        else:
            names = [name for name, _ in model.named_parameters()]
        trainable = freeze_all_but_(model, names)
        trained_model, lora = model, None
        if is_main_process():
            logger.info("mode %s: training %d parameters in %d tensors", config.mode, trainable, len(names))
    for note in notes if is_main_process() else ():
        logger.info(note)
    with scratch_dir:
        trainer = _distillation_trainer_class()(
            model=trained_model, args=arguments, train_dataset=_Rows(train_rows), healing_loss=healing_loss
        )
        if teacher_model is not None:
            teacher_model.to(arguments.device)
        gate = None
        if heldout:
            from .gate import HeldOutGate

            gate = HeldOutGate(
                trained_model,
                healing_loss,
                heldout,
                config.eval_every,
                config.patience,
                config.per_device_train_batch_size,
            )
            trainer.add_callback(gate)
        result = trainer.train()
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        decision = gate.restore_best_() if gate is not None else "no gate (heldout_rows=0)"
    if lora is not None:
        trained_model = trained_model.merge_and_unload()
    else:
        for name, parameter in trained_model.named_parameters():
            parameter.requires_grad_(flags[name])
    trained_model.eval()
    log = {
        "mode": config.mode,
        "teacher": teacher_name,
        "loss": "lm" if teacher_model is None else "distillation",
        "temperature": config.temperature if teacher_model is not None else None,
        "kd_alpha": config.kd_alpha if teacher_model is not None else None,
        "hidden_weight": config.hidden_weight,
        "data_kind": kind,
        "rows": len(train_rows),
        "seqlen": config.seqlen,
        "steps": result.global_step,
        "processes": arguments.world_size,
        "tokens_trained": result.global_step * config.tokens_per_step() * replicas,
        "train_loss": result.training_loss,
        "loss_history": history,
        "learning_rate": config.learning_rate,
        "train_seconds": result.metrics.get("train_runtime"),
        "gate": decision,
        **(gate.summary() if gate is not None else {}),
        **({"notes": notes} if notes else {}),
    }
    if lora is not None:
        log["lora"] = {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(lora.target_modules)}
    if gate is not None and is_main_process():
        before, after = gate.start["objective"], gate.best["objective"]
        logger.info("gate: %s (held-out objective %.4f -> %.4f)", decision, before, after)
    return trained_model, log


def _wrap_lora(model: nn.Module, config: RecoveryConfig) -> tuple[nn.Module, Any]:
    """The peft-wrapped model and its LoraConfig."""
    from peft import LoraConfig, get_peft_model  # its presence was checked with the text (`_training_text`)

    lora = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules or default_target_modules(model),
        layers_to_transform=config.layers_to_transform,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora), lora
