"""Healing a compressed model with transformers' Trainer: LoRA or full-parameter training of a chosen part, on the
LM loss or distilled from the dense model (or, mode 'local', each changed span alone against the teacher's states:
`recovery.local`), behind a held-out gate, returned as a plain model."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import tempfile
from collections.abc import Callable, Mapping, Sized
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig, merges_layers, with_mode
from ..utils.errors import CalibrationDataError
from ..utils.launch import join_launcher_group, launched_world_size
from ..utils.positions import check_sequence_length
from .data import build_training_rows, load_recovery_texts
from .distill import DistillationLoss, LossParts
from .footprint import ModeChoice, teacher_bytes_to_load
from .lora import wrap_lora
from .rate import weight_scale
from .resume import (
    CheckpointState,
    check_checkpoint_options,
    latest_checkpoint,
    phase_folder,
    read_checkpoint,
    read_phase,
    save_phase,
)
from .selection import (
    Span,
    changed_parameter_names,
    changed_spans,
    check_mode,
    freeze_all_but_,
    last_k_parameter_names,
    layer_map,
    span_parameter_names,
    without_embeddings,
)
from .teacher_text import heldout_split, is_teacher_dataset, sample_teacher_rows, seeded_subset

#: A healing objective: one batch's `LossParts` for a model (`DistillationLoss`, `local.LocalSpanLoss`).
Objective = Callable[[nn.Module, dict[str, torch.Tensor]], LossParts]

logger = logging.getLogger(__name__)


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

        def __init__(self, *args: Any, healing_loss: Objective, **kwargs: Any) -> None:
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


def fsdp_version(config: RecoveryConfig, arguments: Any = None) -> int | None:
    """The FSDP version the run asks for, None for none: from the built TrainingArguments (``fsdp=True`` with
    ``fsdp_config={"version": ...}`` in `extra_training_args`; transformers defaults to 2), from those arguments
    before they are built (`check_recovery_inputs`), or from ``accelerate launch --use_fsdp``'s environment (whose
    default is 1)."""
    if arguments is not None:
        plugin = getattr(arguments, "fsdp_plugin_args", None)
        if plugin:
            return int(plugin.get("fsdp_version", 1))
    elif config.extra_training_args.get("fsdp"):
        fsdp_config = config.extra_training_args.get("fsdp_config") or {}
        if isinstance(fsdp_config, Mapping):
            return int(fsdp_config.get("version", fsdp_config.get("fsdp_version", 2)))
        return 2  # a JSON file's path: transformers reads it when the arguments are built, and recover checks again
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def check_fsdp(config: RecoveryConfig, version: int | None) -> None:
    """Refuses, before any weight changes, what healing does not support under FSDP.

    FSDP2 is supported for modes 'full', 'changed' and 'last_k' (the gate gathers whole parameters; see
    `recovery.gate`). FSDP1 is not: the gate would score and snapshot the model inside the wrapper, whose
    parameters are flattened shards, and torch refuses FSDP1 on a CPU, where it could be tested; transformers
    deprecates it. Mode 'local' runs blocks outside the model's forward, so FSDP would never gather them. Mode
    'lora' trains and merges to the right weights under FSDP2 (seen on the CPU), but accelerate shards the peft
    wrapper as the root unit, and the merged model that comes out of it leaves the parameters the root held sharded
    with nothing to gather them: its forward fails ("got mixed torch.Tensor and DTensor"). The gate reshards the
    model after scoring it with `FSDPModule.reset_iter_state`, which older torch lacks.
    """
    if version is None:
        return
    if version != 2:
        raise ValueError(
            f"healing under FSDP needs FSDP2 (fsdp_config={{'version': 2}}, or accelerate launch --fsdp_version 2), "
            f"got version {version}; FSDP1's flattened shards are not supported by the gate."
        )
    if config.mode in ("local", "lora"):
        reason = (
            "runs each span's block outside the model's forward, where FSDP never gathers its parameters"
            if config.mode == "local"
            else "merges its adapters into a model whose root parameters FSDP2 leaves sharded, and its forward fails"
        )
        raise ValueError(
            f"mode={config.mode!r} is not supported under FSDP: it {reason}; pick mode 'changed' (or 'full', "
            "'last_k'), or launch without FSDP."
        )
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "reset_iter_state"):
        raise ValueError(
            f"healing under FSDP2 needs FSDPModule.reset_iter_state, which torch {torch.__version__} lacks (2.13 has "
            "it): the gate reshards the model with it after scoring; upgrade torch or launch without FSDP."
        )


def _steps_for_budget(config: RecoveryConfig, rows: Sized, replicas: int = 1) -> int:
    """max_steps for the (global) token budget, one step reading `replicas` per-process batches; refuses a budget
    the training rows (`rows`: them, or as many placeholders, before the teacher's are sampled) cannot fill."""
    if config.max_tokens is None:
        return config.max_steps
    if config.max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive token budget, got {config.max_tokens}.")
    per_step = config.tokens_per_step() * replicas
    steps = math.ceil(config.max_tokens / per_step)
    available = len(rows) * config.seqlen
    if steps * per_step > available:
        second = config.local_then_global_tokens if config.mode == "local" else None
        budget = f" (the local phase of {config.max_tokens + second} tokens in all)" if second else ""
        raise CalibrationDataError(
            f"max_tokens={config.max_tokens}{budget} needs {steps} steps of {per_step} tokens, but the "
            f"training text holds {len(rows)} rows of {config.seqlen} ({available} tokens) after holding out the "
            "gate's rows; give more text or lower max_tokens."
        )
    return steps


def teacher_share(dataset: Any, config: RecoveryConfig) -> float:
    """The share of the training rows the teacher samples: 1 for ``dataset="teacher"`` (its text only), else
    `RecoveryConfig.teacher_text`; refuses ``"teacher"`` with a share to mix, since there is no text to mix it with."""
    if is_teacher_dataset(dataset):
        if 0 < config.teacher_text < 1:
            raise ValueError(
                f"dataset='teacher' trains on the teacher's text only, so there is no text to mix teacher_text="
                f"{config.teacher_text} with; give the text to mix as the dataset, or drop teacher_text."
            )
        return 1.0
    return float(config.teacher_text)


@dataclasses.dataclass(frozen=True)
class _TeacherRows:
    """How many rows the teacher samples for a healing (`recovery.teacher_text`), and how many user rows it keeps.

    Attributes:
        share: The teacher's share of the training rows.
        train: Training rows the teacher samples.
        heldout: Held-out rows the teacher samples (another seed stream than the training rows).
        user: The user's training rows kept (a seeded choice), so that the teacher's are `share` of them.
    """

    share: float
    train: int
    heldout: int
    user: int


def _rows_needed(config: RecoveryConfig, replicas: int) -> int | None:
    """Training rows the schedule reads, every phase's budget counted (they read the same rows): what the teacher
    needs to sample, since sampling costs; None when the budget is epochs over rows not known yet."""
    phases = [config, *([_global_phase(config)] if config.local_then_global_tokens else [])]
    counts = []
    for phase in phases:
        per_step = phase.rows_per_step() * replicas
        if phase.max_tokens is not None:
            counts.append(math.ceil(phase.max_tokens / (phase.tokens_per_step() * replicas)) * per_step)
        elif phase.max_steps > 0:
            counts.append(phase.max_steps * per_step)
    if counts:
        return max(counts)
    return config.max_samples


def _teacher_rows(config: RecoveryConfig, share: float, user_rows: int, replicas: int) -> _TeacherRows | None:
    """The teacher's part of the training and held-out rows (None without teacher text): `share` of the rows the
    budget reads (`_rows_needed`), never more; without a budget, `share` of the user's rows plus the teacher's."""
    if share <= 0:
        return None
    needed = _rows_needed(config, replicas)
    if needed is None:
        if share >= 1:
            raise ValueError(
                "the teacher samples what the budget reads: give max_tokens (or max_steps, or max_samples) with "
                "teacher text only."
            )
        teacher = round(share * user_rows / (1 - share))
        needed = user_rows + teacher
    else:
        teacher = needed if share >= 1 else round(share * needed)
    user = needed - teacher
    if user > user_rows:
        raise CalibrationDataError(
            f"teacher_text={share} leaves {user} training rows of {config.seqlen} tokens to the given text, which "
            f"holds {user_rows} after holding out the gate's rows; give more text, raise teacher_text or lower "
            "max_tokens."
        )
    return _TeacherRows(share, teacher, heldout_split(config.heldout_rows, share)[1], user)


def _training_text(
    tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str
) -> tuple[list[str], str, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(texts, their kind, training rows, held-out rows), after the checks that need no model: the mode (and the
    local mode's global phase), and, for LoRA, that peft is installed. With teacher text (`teacher_share`) the kind
    is ``teacher`` (no text read) or ``mixed`` (the user's part of the held-out rows split off here)."""
    check_mode(config.mode)
    check_local_options(config)
    check_checkpoint_options(config)
    if config.mode == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise ImportError("healing with mode='lora' needs peft: pip install optimum-flatten[recovery]") from error
    share = teacher_share(dataset, config)
    if share >= 1:
        return [], "teacher", [], []
    texts, kind = load_recovery_texts(dataset, text_column)
    rows = build_training_rows(tokenizer, texts, kind, config.seqlen, config.max_samples, config.seed)
    heldout = heldout_split(config.heldout_rows, share)[0]
    return (texts, kind if share <= 0 else "mixed", *_split_rows(rows, heldout, config.seed))


def check_recovery_inputs(tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str = "text") -> None:
    """The checks of `recover` that need no model: the mode, peft for LoRA, the text and the token budget.

    `FlattenConfig(heal=...)` runs them before the compression touches a weight, so that a heal that cannot run
    is refused while the model is still the dense one.
    """
    check_fsdp(config, fsdp_version(config))
    _, _, train_rows, _ = _training_text(tokenizer, dataset, config, text_column)
    planned = _planned_rows(config, teacher_share(dataset, config), train_rows, _replicas(config))[1]
    _steps_for_budget(config, planned, _replicas(config))
    if config.local_then_global_tokens:
        _steps_for_budget(_global_phase(config), planned, _replicas(config))


def _planned_rows(
    config: RecoveryConfig, share: float, train_rows: list[dict[str, torch.Tensor]], replicas: int
) -> tuple[_TeacherRows | None, range, list[dict[str, torch.Tensor]]]:
    """(the teacher's part, as many placeholders as the training rows will be, the user's rows kept) for the
    budget's checks before the teacher samples anything."""
    plan = _teacher_rows(config, share, len(train_rows), replicas)
    if plan is None:
        return None, range(len(train_rows)), train_rows
    kept = seeded_subset(train_rows, plan.user, config.seed + 2)
    return plan, range(len(kept) + plan.train), kept


def _cache_folder(config: RecoveryConfig) -> str | None:
    """Where the teacher's rows are kept: `teacher_text_cache`, else a folder of `checkpoint_dir` (so that a resumed
    healing reads them back), else nowhere."""
    if config.teacher_text_cache:
        return config.teacher_text_cache
    return os.path.join(config.checkpoint_dir, "teacher_text") if config.checkpoint_dir else None


def _sample_teacher_part(
    teacher: nn.Module, tokenizer: Any, config: RecoveryConfig, plan: _TeacherRows, progress: bool
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], dict[str, Any]]:
    """(training rows, held-out rows, record) the teacher samples for `plan`; the held-out rows come from another
    seed stream, so they are never training rows."""
    options = dict(
        seed=config.seed,
        temperature=config.sampling_temperature,
        top_k=config.sampling_top_k,
        top_p=config.sampling_top_p,
        prompts=config.prompts,
        prompt_tokens=config.teacher_prompt_tokens,
        batch_size=config.sampling_batch_size,
        cache_dir=_cache_folder(config),
        progress=progress,
    )
    train, record = sample_teacher_rows(teacher, tokenizer, plan.train, config.seqlen, stream="train", **options)
    heldout, held = [], None
    if plan.heldout:
        heldout, held = sample_teacher_rows(
            teacher, tokenizer, plan.heldout, config.seqlen, stream="heldout", **options
        )
    record = {"share": plan.share, **record, "user_rows": plan.user}
    if held is not None:
        record["heldout"] = {k: held[k] for k in ("rows", "seconds", "tokens", "cached", "peak_memory_bytes")}
    return train, heldout, record


def _part_scores(
    model: nn.Module, loss: Objective, parts: Mapping[str, list[dict[str, torch.Tensor]]], config: RecoveryConfig
) -> dict[str, dict[str, float]]:
    """The held-out objective, LM loss and KL of each part of the held-out rows (the user's text, the teacher's), for
    the log: the gate decides on all rows together."""
    from .gate import reshard_, score_rows

    scores = {name: score_rows(model, loss, rows, config.per_device_train_batch_size) for name, rows in parts.items()}
    reshard_(model)
    return scores


def check_local_options(config: RecoveryConfig) -> None:
    """Refuses a global phase (`local_then_global_tokens`) outside mode 'local', a budget that is not positive, and
    an unknown `global_scope`."""
    if config.global_scope not in GLOBAL_SCOPES:
        raise ValueError(f"global_scope must be one of {list(GLOBAL_SCOPES)}, got {config.global_scope!r}.")
    tokens = config.local_then_global_tokens
    if tokens is None:
        return
    if config.mode != "local":
        raise ValueError(
            f"local_then_global_tokens continues mode 'local' with the global loss, but the mode is {config.mode!r}; "
            "set mode='local', or leave local_then_global_tokens unset."
        )
    if tokens < 1:
        raise ValueError(f"local_then_global_tokens must be a positive token budget, got {tokens}.")
    rate = config.global_learning_rate
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"global_learning_rate must be a positive number, got {rate}.")


#: What mode 'local''s global phase can train (`RecoveryConfig.global_scope`), and the mode whose default learning
#: rate it takes: the same blocks are what 'changed' trains, every parameter what 'full' trains.
GLOBAL_SCOPES: dict[str, str] = {"spans": "changed", "all": "full"}


def _global_phase(config: RecoveryConfig) -> RecoveryConfig:
    """The options of mode 'local''s global phase: its own token budget and, unless one was given, the learning rate
    of the mode that trains what it trains (`GLOBAL_SCOPES`). The local rate (1e-3) was chosen for a block's own
    state loss; on the global distillation loss it is 5× the rate 'changed' was swept to (measured after FlattenGPT
    on SmolLM2: 32K local then 32K global tokens at the local rate gave 1.467 / 2.503, behind 64K of `local` alone,
    1.425 / 2.402). A rate of the phase's own (`global_learning_rate`) was swept there too: half of `changed`'s was
    ahead on the held-out rows at 32K + 32K and behind them and on both evaluation texts at 128K + 128K (1.234 /
    2.048 against 1.225 / 2.028), and behind on Qwen2.5-0.5B at 32K + 32K (1.196 / 1.643 against 1.186 / 1.601), so
    the default stays `changed`'s."""
    rate: dict[str, Any] = {"mode": GLOBAL_SCOPES[config.global_scope]}  # that mode's default rate, scaled
    if config.global_learning_rate is not None:
        rate = {"learning_rate": config.global_learning_rate}
    elif config.learning_rate is not None:
        rate = {}  # the rate given, for both phases
    tokens = config.local_then_global_tokens
    return dataclasses.replace(config, max_tokens=tokens, local_then_global_tokens=None, **rate)


def _declines_teacher(teacher: Any) -> bool:
    """Whether the caller asked for no teacher (``teacher=False``, or ``"none"`` from the command line)."""
    return teacher is False or (isinstance(teacher, str) and teacher.lower() == "none")


def _has_teacher(teacher: Any, report: Mapping[str, Any] | None) -> bool:
    """Whether `_resolve_teacher` will load a teacher (nothing is loaded here): what the default mode depends on."""
    from .teacher import default_teacher

    if _declines_teacher(teacher):
        return False
    return teacher is not None or default_teacher(report) is not None


def _resolve_teacher(
    teacher: Any, report: Mapping[str, Any] | None, dtype: torch.dtype
) -> tuple[nn.Module | None, Any | None, str | None]:
    """(teacher model, its tokenizer, its public name), or Nones for the LM loss alone."""
    from .gate import is_main_process
    from .teacher import default_teacher, load_teacher

    if _declines_teacher(teacher):
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
    from transformers import TrainingArguments

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
    # Checkpoints (`recovery.resume`) keep the last two: a process killed while writing one still leaves the other.
    saving = {"save_strategy": "steps", "save_steps": config.save_every, "save_total_limit": 2}
    arguments = TrainingArguments(
        output_dir=phase_folder(config, 1) if config.checkpoint_dir else scratch_dir.name,
        learning_rate=config.rate_for(scale),
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        logging_steps=config.logging_steps,
        report_to=[],
        seed=config.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        **{
            # accelerate treats a launch of several CPU processes as distributed only when told it runs on the CPU.
            **({"use_cpu": True} if launched_world_size() > 1 and not torch.cuda.is_available() else {}),
            **(saving if config.save_every else {"save_strategy": "no"}),
            **config.extra_training_args,
        },
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
        state_loss=config.state_loss,
    )
    local_loss = None
    if config.mode == "local":
        from .local import LocalSpanLoss

        local_loss = LocalSpanLoss(model, teacher_model, spans, config.state_loss)  # refuses a shallower teacher
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    if config.mode == "lora":
        trained_model, lora = wrap_lora(model, config)
    else:
        if config.mode == "changed":
            names = changed_parameter_names(model, report)
        elif config.mode == "local":
            names = span_parameter_names(model, spans)
        elif config.mode == "last_k":
            names, note = last_k_parameter_names(model, config.last_k)
            notes += [note] if note and config.trains_embeddings else []
        else:
            names = [name for name, _ in model.named_parameters()]
        if not config.trains_embeddings:
            names = without_embeddings(model, names)
        trainable = freeze_all_but_(model, names)
        trained_model, lora = model, None
        if is_main_process():
            logger.info("mode %s: training %d parameters in %d tensors", config.mode, trainable, len(names))
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
    first, last = phases[0], phases[-1]
    steps = sum(p.steps for p in phases)
    log = {
        "mode": config.mode,
        "mode_chosen": choice.describe(config),
        "teacher": teacher_name,
        "loss": "lm" if teacher_model is None else ("local" if local_loss is not None else "distillation"),
        "temperature": config.temperature if teacher_model is not None else None,
        "kd_alpha": config.kd_alpha if teacher_model is not None else None,
        "hidden_weight": config.hidden_weight,
        "state_loss": config.state_loss if local_loss is not None or config.hidden_weight > 0 else None,
        "data_kind": kind,
        "rows": len(train_rows),
        "seqlen": config.seqlen,
        "rows_per_step": config.rows_per_step(),  # on each process; `tokens_trained` counts all of them
        "steps": steps,
        "processes": arguments.world_size,
        "fsdp": 2 if first.sharded else None,
        "tokens_trained": steps * config.tokens_per_step() * replicas,
        "train_loss": first.result.training_loss,
        "loss_history": first.history,
        "learning_rate": config.rate_for(scale),  # the first phase's (a global phase after `local` has its own)
        "optimizer": str(getattr(arguments.optim, "value", arguments.optim)),  # TrainingArguments.optim
        "weight_scale": scale,
        "train_seconds": sum(p.seconds for p in phases),
        # Where each phase continued from (None: from its start); the folder is not logged: reports keep no paths.
        **({"resumed_from_step": [p.resumed_from for p in phases]} if config.checkpoint_dir else {}),
        "gate": _combined_decision([p.decision for p in phases]),
        **(first.gate.summary() if first.gate is not None else {}),
        **({"notes": notes} if notes else {}),
        **({"teacher_text": teacher_record} if teacher_record is not None else {}),
        **({"heldout_parts": heldout_parts} if parts else {}),
        **({} if config.trains_embeddings else {"embeddings": "frozen (the token embeddings and the LM head)"}),
    }
    if local_loss is not None:
        log["local"] = {
            "spans": [{"block": s.block, "original_layers": [s.start, s.end - 1]} for s in spans],
            "trained": "every parameter of each span's student block",
            "gate_objective": "distillation (global)",
            **({"heldout_local_before": local_before, "heldout_local_after": local_after} if heldout else {}),
        }
        if len(phases) > 1:
            log["global_phase"] = {
                "loss": "distillation",
                "trained": "the same blocks" if config.global_scope == "spans" else "every parameter",
                "learning_rate": arguments.learning_rate,
                "steps": last.steps,
                "tokens_trained": last.steps * config.tokens_per_step() * replicas,
                "train_loss": last.result.training_loss,
                "loss_history": last.history,
                "train_seconds": last.seconds,
                "gate": last.decision,
                **(last.gate.summary() if last.gate is not None else {}),
            }
            if last.gate is not None:
                log["heldout_after"] = last.gate.best
    if lora is not None:
        log["lora"] = {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(lora.target_modules)}
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


@dataclasses.dataclass
class _Phase:
    """One Trainer run of `recover`: its result, loss log, gate, the gate's decision, whether accelerate sharded the
    model (FSDP), its training seconds (every attempt's, when resumed) and the step it was resumed from."""

    result: Any
    history: list[dict[str, Any]]
    gate: Any
    decision: str
    sharded: bool = False
    seconds: float = 0.0
    resumed_from: int | None = None

    @property
    def steps(self) -> int:
        return int(self.result.global_step)

    def record(self) -> dict[str, Any]:
        """What a resume needs to replay this phase once it has finished (`recovery.resume.save_phase`)."""
        return {
            "steps": self.steps,
            "train_loss": self.result.training_loss,
            "history": self.history,
            "gate": self.gate.summary() if self.gate is not None else None,
            "decision": self.decision,
            "sharded": self.sharded,
            "seconds": self.seconds,
            "resumed_from": self.resumed_from,
        }


@dataclasses.dataclass
class _RecordedGate:
    """A finished phase's gate as its record holds it: the summary the log reads, nothing to train with."""

    saved: dict[str, Any]

    @property
    def start(self) -> dict[str, float]:
        return self.saved["heldout_before"]

    @property
    def best(self) -> dict[str, float]:
        return self.saved["heldout_after"]

    def summary(self) -> dict[str, Any]:
        return self.saved


@torch.no_grad()
def _replayed_phase(model: nn.Module, record: dict[str, Any], trained: dict[str, torch.Tensor]) -> _Phase:
    """A finished phase from its record: the state it ended on loaded into `model`, its log as it was."""
    from transformers.trainer_utils import TrainOutput

    from .gate import load_trainable_state_

    load_trainable_state_(model, trained, "the finished phase's state")
    result = TrainOutput(record["steps"], record["train_loss"], {"train_runtime": record["seconds"]})
    gate = _RecordedGate(record["gate"]) if record["gate"] is not None else None
    return _Phase(
        result, record["history"], gate, record["decision"], record["sharded"], record["seconds"],
        record["resumed_from"],
    )  # fmt: skip


def _train_phase(
    model: nn.Module,
    arguments: Any,
    rows: list[dict[str, torch.Tensor]],
    heldout: list[dict[str, torch.Tensor]],
    loss: Objective,
    gate_loss: Objective,
    config: RecoveryConfig,
    index: int = 1,
) -> _Phase:
    """Trains `model` on `loss` for `arguments.max_steps`, behind a gate scoring `gate_loss`, best state restored.

    With `config.checkpoint_dir` the phase (`index`) trains in its own folder, checkpointed with the gate's state
    (`recovery.resume`): a phase the folder records as finished is replayed from its record, an unfinished one
    continues from its newest complete checkpoint."""
    from .gate import is_main_process, trainable_state

    folder = phase_folder(config, index) if config.checkpoint_dir else None
    if folder is not None and (done := read_phase(folder, config)) is not None:
        return _replayed_phase(model, *done)
    checkpoint = latest_checkpoint(folder) if folder is not None else None
    saved = read_checkpoint(checkpoint, config) if checkpoint is not None else None
    if folder is not None:
        arguments.output_dir = folder
    trainer = _distillation_trainer_class()(model=model, args=arguments, train_dataset=_Rows(rows), healing_loss=loss)
    gate = None
    if heldout:
        from .gate import HeldOutGate

        gate = HeldOutGate(
            model,
            gate_loss,
            heldout,
            config.eval_every,
            config.patience,
            config.per_device_train_batch_size,
            state=saved["gate"] if saved is not None else None,
        )
        trainer.add_callback(gate)
    clock = None
    if folder is not None:
        clock = CheckpointState(gate, config, saved["seconds"] if saved is not None else 0.0, is_main_process())
        trainer.add_callback(clock)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    decision = gate.restore_best_() if gate is not None else "no gate (heldout_rows=0)"
    seconds = clock.seconds() if clock is not None else result.metrics.get("train_runtime") or 0.0
    phase = _Phase(
        result, history, gate, decision, bool(getattr(trainer, "is_fsdp_enabled", False)), seconds,
        saved["step"] if saved is not None else None,
    )  # fmt: skip
    if folder is not None:
        trained = trainable_state(model)
        if is_main_process():
            save_phase(folder, config, phase.record(), trained)
    return phase


def _combined_decision(decisions: list[str]) -> str:
    """The gate's decision over the phases: the input weights are kept only when every phase kept its input."""
    from .gate import IMPROVED, KEPT_INPUT

    if all(d == KEPT_INPUT for d in decisions):
        return KEPT_INPUT
    return IMPROVED if any(d == IMPROVED for d in decisions) else decisions[-1]


def _score(model: nn.Module, loss: Objective, rows: list[dict[str, torch.Tensor]], config: RecoveryConfig) -> float:
    """The held-out value of `loss` (0 rows: nan), for the log."""
    from .gate import score_rows

    if not rows:
        return float("nan")
    return score_rows(model, loss, rows, config.per_device_train_batch_size)["objective"]
