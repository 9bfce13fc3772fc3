"""The rows a healing trains and gates on (`HealingRows`): the user's text cut into rows, the teacher's own text
(`recovery.teacher_text`) for its share of them, and the gate's held-out rows of each part, settled in three steps:
read before the model is touched (`read_rows`), planned once the launch's processes are known (`HealingRows.plan_`),
sampled once the teacher is on its device (`HealingRows.add_teacher_part_`).

A new source of healing text is a new way to fill the plan (`_teacher_rows`) and a sampler in
`_sample_teacher_part`'s place; the user's text formats register in `recovery.data`."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sized
from typing import Any

import torch
from torch import nn

from ..calibration.data import require_existing
from ..options.recovery import RecoveryConfig
from ..utils.errors import CalibrationDataError
from .arguments import _global_phase, _replicas, _steps_for_budget, check_fsdp, check_local_options, fsdp_version
from .data import build_training_rows, load_recovery_texts
from .distill import Objective
from .resume import check_checkpoint_options
from .seeded import seeded_split, seeded_subset
from .selection import check_mode
from .teacher import _TEXT_NEEDS_TEACHER
from .teacher_start import checked_start, mask_opening, prompt_ids, prompt_texts, split_prompts
from .teacher_text import heldout_split, is_teacher_dataset, sample_teacher_rows
from .text_repetition import mask_repeats
from .vllm_sampling import require_vllm

logger = logging.getLogger(__name__)

#: One row of token ids (and its attention mask and labels), as `recovery.data.build_training_rows` cuts them.
Row = dict[str, torch.Tensor]


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
    return seeded_split(rows, heldout, seed + 1)


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


#: The options that only say how the teacher samples its own text (`RecoveryConfig`): given without any teacher
#: text they would do nothing, so they are refused rather than ignored (teacher_text_cache and the checkpoint
#: folder may stay: a line that heals on the user's text alone keeps them harmlessly).
SAMPLING_OPTIONS = (
    "prompts",
    "teacher_prompt_tokens",
    "sampling_temperature",
    "sampling_top_k",
    "sampling_top_p",
    "sampling_batch_size",
    "sampling_backend",
    "sampling_start",
    "teacher_text_loops",
)


def _sampling_options_given(config: RecoveryConfig) -> list[str]:
    """The `SAMPLING_OPTIONS` set to other than their defaults, each as ``name=value``."""
    defaults = {f.name: f.default for f in dataclasses.fields(RecoveryConfig)}
    return [f"{name}={getattr(config, name)!r}" for name in SAMPLING_OPTIONS if getattr(config, name) != defaults[name]]


def check_teacher_text_options(tokenizer: Any, config: RecoveryConfig, share: float, text_column: str = "text") -> None:
    """The teacher text's checks that need no model, so that `recover` and `FlattenConfig(heal=...)` refuse them (one
    line each) before any weight changes: vLLM where it samples, a start that leaves tokens to sample (a chat
    template where the chat turn starts the rows), prompts that hold `teacher_prompt_tokens` tokens, and the loops'
    mask only where it has teacher text to mask and a loss that reads it."""
    if share <= 0:
        if given := _sampling_options_given(config):
            raise ValueError(
                f"{', '.join(given)} set{'s' if len(given) == 1 else ''} how the teacher samples its own text, and "
                "this healing samples none; give teacher_text > 0 (or dataset='teacher'), or drop "
                f"{'it' if len(given) == 1 else 'them'}."
            )
        return
    if config.sampling_backend == "vllm":
        require_vllm()
    prompted = config.prompts is not None
    checked_start(tokenizer, config.sampling_start, config.seqlen, config.teacher_prompt_tokens, prompted)
    if prompted:
        prompt_ids(tokenizer, config.prompts, config.teacher_prompt_tokens, text_column)
    if config.teacher_text_loops == "mask" and (config.mode == "local" or config.hidden_weight):
        raise ValueError(
            "teacher_text_loops='mask' leaves tokens out of the next-token losses, but mode 'local' and the hidden-"
            "state terms compare states at every position and would still learn the loops; heal with mode='full' "
            "and hidden_weight=0, or leave teacher_text_loops='train'."
        )


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
    check_teacher_text_options(tokenizer, config, share, text_column)
    if share >= 1:
        return [], "teacher", [], []
    texts, kind = load_recovery_texts(dataset, text_column, tokenizer)
    rows = build_training_rows(tokenizer, texts, kind, config.seqlen, config.max_samples, config.seed)
    heldout = heldout_split(config.heldout_rows, share)[0]
    return (texts, kind if share <= 0 else "mixed", *_split_rows(rows, heldout, config.seed))


def _same_source(dataset: Any, guard: Any) -> bool:
    """Whether the guard is the training text itself: the same path, or the same list of texts."""
    if isinstance(dataset, (str, os.PathLike)) and isinstance(guard, (str, os.PathLike)):
        return os.path.abspath(os.fspath(dataset)) == os.path.abspath(os.fspath(guard))
    return isinstance(dataset, (list, tuple)) and isinstance(guard, (list, tuple)) and list(dataset) == list(guard)


def _guard_rows(tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str) -> list[Row]:
    """`heldout_rows` rows of `config.guard_text` (a seeded choice), the gate's guard (`recovery.gate`); none
    without one. Refuses a guard without the gate, the training text or the teacher's prompts given again as its own
    guard, and a guard text too short for one row, before any model changes."""
    if config.guard_text is None:
        return []
    if config.heldout_rows < 1:
        raise ValueError("guard_text is scored by the gate: give heldout_rows of at least 1 (0 turns the gate off).")
    if _same_source(dataset, config.guard_text):
        raise ValueError(
            "guard_text is the training text itself, so its rows would be trained on; give a text the healing does "
            "not train on (in a mix, the training text's held-out rows guard it already)."
        )
    if config.prompts is not None and _same_source(config.prompts, config.guard_text):
        raise ValueError(
            "guard_text is the prompts' text, whose openings start the teacher's training rows and are trained on; "
            "give a guard text the healing does not see."
        )
    if isinstance(config.guard_text, (str, os.PathLike)):
        require_existing(config.guard_text, "guard_text (--guard-text)")
    texts, kind = load_recovery_texts(config.guard_text, text_column, tokenizer)
    try:
        rows = build_training_rows(tokenizer, texts, kind, config.seqlen, None, config.seed)
    except CalibrationDataError:
        rows = []
    if not rows:
        raise CalibrationDataError(
            f"guard_text holds no row of {config.seqlen} tokens; give a longer text or lower seqlen."
        ) from None
    return seeded_subset(rows, config.heldout_rows, config.seed + 3)


def check_recovery_inputs(tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str = "text") -> None:
    """The checks of `recover` that need no model: the mode, peft for LoRA, the text and the token budget.

    `FlattenConfig(heal=...)` runs them before the compression touches a weight, so that a heal that cannot run
    is refused while the model is still the dense one.
    """
    check_fsdp(config, fsdp_version(config))
    share = teacher_share(dataset, config)
    _, _, train_rows, _ = _training_text(tokenizer, dataset, config, text_column)
    _guard_rows(tokenizer, dataset, config, text_column)
    planned = _planned_rows(config, share, train_rows, _replicas(config))[1]
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
    teacher: nn.Module,
    tokenizer: Any,
    config: RecoveryConfig,
    plan: _TeacherRows,
    progress: bool,
    text_column: str = "text",
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], dict[str, Any]]:
    """(training rows, held-out rows, record) the teacher samples for `plan`; the held-out rows come from another
    seed stream and other prompts, so they are never training rows, and they score only what the teacher wrote."""
    options = dict(
        seed=config.seed,
        temperature=config.sampling_temperature,
        top_k=config.sampling_top_k,
        top_p=config.sampling_top_p,
        prompt_tokens=config.teacher_prompt_tokens,
        start=config.sampling_start,
        batch_size=config.sampling_batch_size,
        cache_dir=_cache_folder(config),
        # A folder of checkpoint_dir is this job's: another key's rows there are refused. A teacher_text_cache is the
        # user's to share: another key samples again there.
        one_job=not config.teacher_text_cache,
        progress=progress,
        backend=config.sampling_backend,
    )
    # A table of prompts is read in the healing text's column.
    prompts = None if config.prompts is None else prompt_texts(config.prompts, text_column)
    train_prompts = heldout_prompts = prompts
    if prompts is not None and plan.heldout:  # held-out rows continue prompts no training row continues
        train_prompts, heldout_prompts = split_prompts(
            tokenizer, prompts, config.teacher_prompt_tokens, plan.heldout, config.seed
        )
    train, record = sample_teacher_rows(
        teacher, tokenizer, plan.train, config.seqlen, stream="train", prompts=train_prompts, **options
    )
    heldout, held = [], None
    if plan.heldout:
        heldout, held = sample_teacher_rows(
            teacher, tokenizer, plan.heldout, config.seqlen, stream="heldout", prompts=heldout_prompts, **options
        )
        mask_opening(heldout, held["opening_tokens"])
    record = {"share": plan.share, **record, "user_rows": plan.user}
    if config.teacher_text_loops == "mask":  # the same mask on the held-out rows: the gate scores what trains
        masked = mask_repeats(train) + mask_repeats(heldout)
        tokens = sum(int(row["input_ids"].numel()) for row in (*train, *heldout))
        record["loops_masked"] = {"tokens": masked, "share": round(masked / max(tokens, 1), 4)}
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


def checked_share(dataset: Any, config: RecoveryConfig, has_teacher: bool) -> float:
    """The teacher's share of the training rows (`teacher_share`); refuses teacher text without a teacher, before the
    text is read."""
    share = teacher_share(dataset, config)
    if share > 0 and not has_teacher:
        raise ValueError(_TEXT_NEEDS_TEACHER)
    return share


#: The log's note (printed by `recover`) for a healing on the teacher's text alone with the gate on and no guard: the
#: gate then scores only the teacher's own rows, whose objective fell on Qwen2.5-Coder while real prose got worse
#: (benchmarks/NOTEBOOK.md, "A guard for the text a user cares about").
UNGUARDED_NOTE = (
    "unguarded: the gate scored the teacher's own rows only, which can improve while real text gets worse; "
    "guard_text (recover --guard-text FILE; heal={'guard_text': ...}) keeps no state that makes your text worse"
)


def unguarded_notes(config: RecoveryConfig, share: float) -> list[str]:
    """`UNGUARDED_NOTE` where it applies: a gate that holds out none of the user's rows (the teacher's text only, or a
    mix whose held-out rows are all the teacher's) and no guard; else nothing."""
    user_heldout = heldout_split(config.heldout_rows, share)[0]
    unguarded = share > 0 and config.heldout_rows > 0 and user_heldout == 0 and config.guard_text is None
    return [UNGUARDED_NOTE] if unguarded else []


@dataclasses.dataclass
class HealingRows:
    """The healing's text and rows as the steps settle them.

    Attributes:
        texts: The user's texts (none for the teacher's text only): what the teacher's tokenizer is checked on.
        kind: What the rows are (`load_recovery_texts`' kind, ``teacher`` or ``mixed``), for the log.
        share: The teacher's share of the training rows.
        train: The training rows (the user's kept, then the teacher's after `add_teacher_part_`).
        heldout: The gate's held-out rows (both parts after `add_teacher_part_`).
        plan: The teacher's part (None without teacher text), from `plan_`.
        planned: As many placeholders as the training rows will be, for the budget's checks before sampling.
        record: The teacher's sampling record for the log (None without teacher text).
        parts: The held-out rows by part (``user``, ``teacher``) when both have some, scored apart for the log.
        guard: Rows the gate may not let get worse (`guard_text`'s, else in a mix the user's held-out part).
        text_column: The healing text's column, in which a table of teacher prompts is read too.
    """

    texts: list[str]
    kind: str
    share: float
    train: list[Row]
    heldout: list[Row]
    plan: _TeacherRows | None = None
    planned: Sized = range(0)
    record: dict[str, Any] | None = None
    parts: dict[str, list[Row]] = dataclasses.field(default_factory=dict)
    guard: list[Row] = dataclasses.field(default_factory=list)
    text_column: str = "text"

    def plan_(self, config: RecoveryConfig, replicas: int) -> None:
        """Plans the teacher's part for a step reading `replicas` per-process batches, keeping a seeded choice of the
        user's rows; refuses a share the user's rows cannot fill."""
        self.plan, self.planned, self.train = _planned_rows(config, self.share, self.train, replicas)

    def add_teacher_part_(
        self, teacher: nn.Module | None, tokenizer: Any, config: RecoveryConfig, progress: bool
    ) -> None:
        """Samples the planned teacher rows (nothing without a plan) and adds them to the training and held-out rows."""
        if self.plan is None:
            return
        sampled, sampled_heldout, self.record = _sample_teacher_part(
            teacher, tokenizer, config, self.plan, progress, self.text_column
        )
        if self.heldout and sampled_heldout:
            self.parts = {"user": self.heldout, "teacher": sampled_heldout}
            self.guard = self.guard or list(self.heldout)  # the user's text, which a mix must not make worse
        self.train, self.heldout = [*self.train, *sampled], [*self.heldout, *sampled_heldout]

    def part_scores(
        self, model: nn.Module, loss: Objective, config: RecoveryConfig, device: Any = None
    ) -> dict[str, dict[str, float]] | None:
        """Each held-out part's scores (`_part_scores`; None without parts), the model first moved to `device` when
        one is given."""
        if not self.parts:
            return None
        if device is not None:
            model.to(device)
        return _part_scores(model, loss, self.parts, config)


def read_rows(tokenizer: Any, dataset: Any, config: RecoveryConfig, text_column: str, share: float) -> HealingRows:
    """The user's text and rows (`_training_text`, with its checks that need no model), before any model changes."""
    texts, kind, train, heldout = _training_text(tokenizer, dataset, config, text_column)
    guard = _guard_rows(tokenizer, dataset, config, text_column)
    return HealingRows(texts, kind, share, train, heldout, guard=guard, text_column=text_column)
