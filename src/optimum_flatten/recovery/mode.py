"""The first step of a healing: the mode it trains in, chosen where the caller left it to the default by what the run
has (a teacher, a plan, FSDP, layers merged) and by whether whole-model training fits in memory (`footprint`).

A new mode registers in `selection.MODES` (and `options.recovery.with_mode` where it can be a default); its memory,
where it needs more than the weights, in `footprint.ModeChoice`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..options.recovery import RecoveryConfig, local_then_global, merges_layers, with_mode
from ..utils.causal_lm import check_causal_lm
from ..utils.launch import join_launcher_group
from ..utils.positions import check_sequence_length
from .arguments import fsdp_version
from .footprint import Budget, ModeChoice, teacher_bytes_to_load, training_device, weight_bytes
from .resume import same_options, started_options
from .rows import teacher_share
from .teacher import _has_teacher
from .teacher_text import is_teacher_dataset


def resolve_mode(
    model: nn.Module, dataset: Any, config: RecoveryConfig, teacher: Any, report: Mapping[str, Any] | None
) -> tuple[RecoveryConfig, Mapping[str, Any] | None, ModeChoice]:
    """(the config with its mode settled, the report (``model.flatten_report`` when none was given), how the mode was
    chosen), after refusing a model that is no causal LM and rows longer than the model's position table."""
    check_causal_lm(model)
    if is_teacher_dataset(dataset):  # the teacher's text only: the log, the footprint and a resume see share 1
        config = dataclasses.replace(config, teacher_text=teacher_share(dataset, config))
    # A row past a position table fails inside the first step; refused here, before anything is built or changed.
    check_sequence_length(model, config.seqlen, "the healing's seqlen")
    # Under torchrun / accelerate launch the ranks are joined first, so that they agree on the mode (each checks its
    # own memory) before the Trainer wraps the model.
    join_launcher_group()
    if report is None:
        report = getattr(model, "flatten_report", None)
    device = training_device(model, config)
    choice = ModeChoice(model, config, lambda: teacher_bytes_to_load(model, teacher, report, device))
    started = as_started(config)
    if started is not None:
        choice.line = AS_STARTED
        return started, report, choice
    config = with_mode(
        config,
        has_teacher=_has_teacher(teacher, report),
        has_plan=bool((report or {}).get("plan")),
        fsdp=fsdp_version(config) is not None,
        full_fits=choice,
        merged=merges_layers((report or {}).get("plan")),
    )
    return choice.apply(config), report, choice


def compress_heal_mode(
    model: nn.Module, config: RecoveryConfig, budget: Budget | None = None
) -> tuple[RecoveryConfig, ModeChoice]:
    """(`config` with its mode settled, how it was chosen) for ``FlattenConfig(heal=...)`` / ``compress
    --heal-tokens``: chosen on the dense `model` before any weight changes, with the dense weights as the teacher
    copy still to be taken, the plan to come, and `full` by default where its memory fits (`ModeChoice`).

    The dense model stands for the student it will become (an upper bound: the compression only removes weights),
    since the choice comes before the compression, whose every refusal must come before any work.

    Why one function: `FlattenQuantizer` asks it with the memory read on the loaded model, and `estimate --heal` with
    a `budget` (a device's free memory given, the model on meta), so that the two cannot size the healing on
    different models (they did: the estimate sized the compressed model with no teacher, and said AdamW fits at
    LLaMA-2-7B on 80 GB where the run fell back to a lean optimiser)."""
    fsdp = fsdp_version(config) is not None
    choice = ModeChoice(model, config, lambda: weight_bytes(model), budget)  # the teacher copy still to be taken
    resolved = with_mode(config, has_teacher=True, has_plan=True, fsdp=fsdp, full_fits=choice)
    return choice.apply(resolved), choice


#: How the log and the model card say that a resumed healing kept the mode its first attempt chose.
AS_STARTED = "as the healing in checkpoint_dir chose it when it started"

#: The training arguments the default's memory check may add (a lean optimiser, FSDP across ranks).
CHOSEN_ARGUMENTS = ("optim", "fsdp", "fsdp_config")


def as_started(config: RecoveryConfig) -> RecoveryConfig | None:
    """`config` with what the default chose when the healing in its checkpoint folder started (the mode, a split
    into local then global, frozen embeddings, a lean optimiser or FSDP), where the caller left them to the default
    and the result is the options that healing was started with; else None (a fresh run, or other options, which the
    resume then refuses naming what differs).

    Why: the default follows the memory free when it is asked, and that changes between attempts on a shared
    machine; the line that started the healing, run again, must continue it, not be refused for a mode it never
    named."""
    saved = started_options(config)
    if saved is None or config.mode is not None:
        return None
    split = saved.get("mode") == "local" and saved.get("local_then_global_tokens") is not None
    if split and config.local_then_global_tokens is None:
        candidate = local_then_global(dataclasses.replace(config, mode="full"))
    else:
        candidate = dataclasses.replace(config, mode=saved.get("mode"))
    if config.train_embeddings is None:
        candidate = dataclasses.replace(candidate, train_embeddings=saved.get("train_embeddings"))
    given = config.extra_training_args
    chosen = {k: v for k, v in (saved.get("extra_training_args") or {}).items() if k in CHOSEN_ARGUMENTS}
    candidate = dataclasses.replace(candidate, extra_training_args={**chosen, **given})
    return candidate if same_options(saved, candidate) else None
