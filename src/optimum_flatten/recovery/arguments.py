"""What a healing's budget becomes in the Trainer's terms (`healing_schedule`): the TrainingArguments, how many
per-process batches a step reads (`_replicas`), the steps a token budget takes (`_steps_for_budget`), FSDP's version
and what it supports, and the options of mode `local`'s global phase. Checked before any weight changes, so a budget
the text cannot fill is refused early. A new Trainer option is an entry of `training_arguments` (or, for a user,
`RecoveryConfig.extra_training_args`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sized
from typing import Any

import torch

from ..options.recovery import RecoveryConfig
from ..utils.errors import CalibrationDataError, did_you_mean
from .resume import phase_folder

logger = logging.getLogger(__name__)


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


def check_in_memory(model: Any) -> None:
    """Refuses, before any weight changes, a model with layers offloaded to CPU or disk by ``device_map`` (accelerate's
    hooks keep their weights on the meta device between forwards): the optimiser steps on weights that are not there,
    the gate copies them, and the teacher copy cannot be moved, each failing only once the healing has begun."""
    from ..utils.offload import is_offloaded

    if is_offloaded(model):
        raise ValueError(
            "healing trains weights in memory, and this model has layers offloaded to CPU or disk by its device_map; "
            "load it without offloading (device_map=None or a single device) to heal it, or compress it without heal."
        )


def check_one_device_per_process(model: Any, config: RecoveryConfig) -> None:
    """Refuses one process that sees several GPUs, before any weight changes: the Trainer would wrap the student in
    torch's DataParallel over all of them, so that each step reads a batch per GPU the budget never counted (the
    rows run out and repeat), mode `local` trains across replicas it cannot, and the hidden-state terms record one
    replica's slice of the batch. A model placed by ``device_map`` on other GPUs than the first, or on several, is
    left alone, by the Trainer's own rule (its CPU and disk entries aside): the Trainer does not wrap it."""
    from ..utils.launch import launched_world_size

    if launched_world_size() > 1 or config.extra_training_args.get("use_cpu") or not torch.cuda.is_available():
        return
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} - {"cpu", "disk"}
    if len(placed) > 1 or getattr(model, "model_parallel", False):
        return
    if len(placed) == 1 and torch.device(_cuda_index(placed.pop())) != torch.device("cuda", 0):
        return  # the Trainer's model parallelism: one device, not the one it would train on
    count = torch.cuda.device_count()
    if count > 1:
        raise ValueError(
            f"this one process sees {count} GPUs, and the Trainer would split each batch over them with DataParallel, "
            f"which the healing does not count: launch a process a GPU (torchrun --nproc-per-node {count} ...), or "
            "show this one a single GPU (CUDA_VISIBLE_DEVICES=0)."
        )


def _cuda_index(device: str) -> str:
    """A device map's entry as torch names it: ``0`` is ``cuda:0``."""
    return f"cuda:{device}" if device.isdigit() else device


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


def warn_rounded_budget(config: RecoveryConfig, steps: int, replicas: int = 1) -> None:
    """Says when whole steps train more tokens than `max_tokens` asked for: a step reads a whole batch, so a budget
    that is not a multiple of one rounds up (256 tokens with batches of 1,024 train 1,024), and the record's count
    would otherwise be the only place a user sees it."""
    from ..utils.launch import is_writer

    if config.max_tokens is None or not is_writer():
        return
    per_step = config.tokens_per_step() * replicas
    if steps * per_step != config.max_tokens:
        logger.warning(
            "max_tokens=%d rounds up to %d whole step%s of %d tokens: %d tokens train.",
            config.max_tokens,
            steps,
            "" if steps == 1 else "s",
            per_step,
            steps * per_step,
        )


def check_local_options(config: RecoveryConfig) -> None:
    """Refuses a global phase (`local_then_global_tokens`) outside mode 'local', a budget that is not positive, and
    an unknown `global_scope`."""
    if config.global_scope not in GLOBAL_SCOPES:
        raise ValueError(f"global_scope must be one of {list(GLOBAL_SCOPES)}, got {config.global_scope!r}.")
    if config.global_scope != "spans" and config.mode not in (None, "local"):
        raise ValueError(
            f"global_scope chooses what mode 'local''s global phase trains, but the mode is {config.mode!r}; set "
            "mode='local' with local_then_global_tokens, or leave global_scope unset."
        )
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


#: What mode 'local''s global phase can train (`RecoveryConfig.global_scope`), and the mode whose default learning
#: rate it takes: the same blocks are what 'changed' trains, every parameter what 'full' trains.
GLOBAL_SCOPES: dict[str, str] = {"spans": "changed", "all": "full"}


def _global_phase(config: RecoveryConfig) -> RecoveryConfig:
    """The options of mode 'local''s global phase: its own token budget and, unless one was given, the learning rate
    of the mode that trains what it trains (`GLOBAL_SCOPES`). The local rate was chosen for a block's own state
    loss and is too large for the global distillation loss (the split trained at it fell behind `local` alone); a
    rate of the phase's own was swept and did not beat the trained mode's on both models. The runs:
    benchmarks/NOTEBOOK.md, "Healing" (the global phase's rate)."""
    rate: dict[str, Any] = {"mode": GLOBAL_SCOPES[config.global_scope]}  # that mode's default rate, scaled
    if config.global_learning_rate is not None:
        rate = {"learning_rate": config.global_learning_rate}
    elif config.learning_rate is not None:
        rate = {}  # the rate given, for both phases
    tokens = config.local_then_global_tokens
    return dataclasses.replace(config, max_tokens=tokens, local_then_global_tokens=None, **rate)


def check_extra_training_args(config: RecoveryConfig) -> None:
    """Refuses `extra_training_args` that `TrainingArguments` would refuse only when the healing starts (after a
    compression asked to heal had changed the weights): a key it has no field for, and a rate that is not a positive
    number (the optimiser's own refusal)."""
    from transformers import TrainingArguments

    extra = config.extra_training_args
    fields = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        raise ValueError(
            f"extra_training_args got {unknown}, which TrainingArguments has no field for."
            f"{did_you_mean(unknown[0], fields)}"
        )
    rate = extra.get("learning_rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"extra_training_args' learning_rate must be a positive number, got {rate!r}.")


def training_arguments(config: RecoveryConfig, scale: float, output_dir: str) -> Any:
    """transformers' `TrainingArguments` of a healing: the config's batch, rate (scaled to the weights, `scale`) and
    seed, checkpoints every `save_every` steps keeping the last two (a process killed while writing one still leaves
    the other), and `extra_training_args` over everything. Building them joins the processes of a launch."""
    from transformers import TrainingArguments

    from ..utils.launch import launched_world_size

    saving = {"save_strategy": "steps", "save_steps": config.save_every, "save_total_limit": 2}
    return TrainingArguments(
        output_dir=output_dir,
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


@dataclasses.dataclass
class Schedule:
    """A healing's TrainingArguments and what they settle: the FSDP version asked for (None: none), the per-process
    batches one step reads (`_replicas`), and mode 'local''s global phase's steps (0: no global phase)."""

    arguments: Any
    fsdp: int | None
    replicas: int
    global_steps: int = 0

    def budget_(self, config: RecoveryConfig, planned: Sized) -> None:
        """Sets the first phase's steps for the token budget over the `planned` training rows; refuses a budget they
        cannot fill."""
        self.arguments.max_steps = _steps_for_budget(config, planned, self.replicas)
        warn_rounded_budget(config, self.arguments.max_steps, self.replicas)


def healing_schedule(config: RecoveryConfig, scale: float, scratch: str) -> Schedule:
    """The arguments (in phase 1's checkpoint folder with `checkpoint_dir`, else in `scratch`), then the FSDP checks.

    Building the arguments joins the processes of a distributed launch, and the budget's steps depend on how many
    there are, so this comes before the budget is checked (`Schedule.budget_`)."""
    arguments = training_arguments(config, scale, phase_folder(config, 1) if config.checkpoint_dir else scratch)
    fsdp = fsdp_version(config, arguments)
    check_fsdp(config, fsdp)
    return Schedule(arguments, fsdp, _replicas(config, arguments.world_size))
