"""Healing's options: a torch-free declaration, read by `recover`, the command line's ``recover`` flags and the
report (recovery/trainer.py trains)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..utils.errors import reject_unknown_keys
from .hints import check_option_types

#: The learning rate of each mode unless one is given, at the weight scale they were chosen on
#: (`SWEPT_WEIGHT_SCALE`): LoRA's is the FlattenGPT paper's; every other one the best of a sweep at 16K tokens on
#: SmolLM2-135M, scored by the gate's held-out KL of the *training* text (the evaluation texts not loaded). The sweeps
#: are benchmarks/results/lrsweep_smollm2_*_16384.json, read in NOTEBOOK.md ("Healing", "The protocol"). The modes
#: of `WEIGHT_SCALED_MODES` scale theirs to the model (`RecoveryConfig.rate_for`).
DEFAULT_LEARNING_RATES: dict[str, float] = {"lora": 1e-4, "local": 1e-3, "changed": 2e-4, "last_k": 2e-4, "full": 6e-5}

#: The weight scale the default rates were swept at: the median root-mean-square entry of SmolLM2-135M's weight
#: matrices (0.1901 dense, 0.1903 with 6 of its 30 layers removed). Adam moves every entry by about the rate whatever
#: the entry's size, so one rate is a 12 times larger relative step on Qwen2.5-0.5B, whose median is 0.0162: there a
#: single Adam step of the whole model at 6e-5 took a batch's KL to the dense model from 0.20 to 2.92 (at 1e-5 still
#: to 0.45), while at the scaled 5.1e-6 it fell to 0.198 (benchmarks/recovery/first_step.py); healing with the
#: scaled rate then improved Qwen's held-out KL where 6e-5 had doubled it (benchmarks/NOTEBOOK.md).
SWEPT_WEIGHT_SCALE: float = 0.19

#: The modes whose optimiser steps the model's own weights, so that their default rate follows the weights' scale.
#: LoRA steps adapters of its own initialisation, and keeps the paper's rate.
WEIGHT_SCALED_MODES: tuple[str, ...] = ("local", "changed", "last_k", "full")


@dataclass
class RecoveryConfig:
    """What to train, on which loss, for how long, and the gate. LoRA defaults follow the FlattenGPT paper
    (r=8, alpha=16, lr 1e-4, 2 epochs).

    Attributes:
        mode: What is trained (None: `default_mode`): ``lora`` (PEFT adapters on the projections, merged back),
            ``changed`` (all parameters of merged blocks and the projections carrying a bridge or compensation, per the
            compression report; everything else stays bit-identical), ``local`` (every parameter of each changed span's
            block (merged, covering dropped layers, or carrying a correction), each trained alone towards the teacher's
            state at the end of the span it replaced, on the teacher's state at its start: no backward through the
            model, no LM head; needs a teacher; see `recovery.local`), ``last_k`` (the last `last_k` blocks, the final
            norm and the LM head), ``full`` (every parameter).
        local_then_global_tokens: With ``mode='local'``, a second phase of this many tokens on the global
            distillation loss (the text must hold that many training tokens too); None: none.
        global_scope: What that global phase trains: ``spans`` (the same blocks as the local phase, at mode
            ``'changed'``'s default rate) or ``all`` (every parameter, at mode ``'full'``'s: the local phase then
            only warms up the blocks `full` would start from far off).
        global_learning_rate: That global phase's rate, used as given; None takes `learning_rate` when given, else
            the default of the mode that trains what it trains (`global_scope`), scaled like theirs (`rate_for`).
        last_k: Blocks trained by ``mode='last_k'``.
        train_embeddings: Whether the modes that reach them (``full``, ``last_k``, and a global phase with
            ``global_scope='all'``) train the token embeddings and the LM head (one tensor when tied); False keeps
            both as they are. Measured after ReplaceMe on SmolLM2-135M at 64K tokens (`full`, two healing seeds;
            benchmarks/NOTEBOOK.md), freezing the tied embedding gave the same model to within 0.003 of the
            perplexity ratio on both texts and 0.0003 of the gate's held-out KL, while the training state shrinks
            by what the embedding holds: 21% of SmolLM2-135M's parameters, 28% of Qwen2.5-0.5B's, 62% of
            Gemma-3-270M's. On Gemma-3-270M (SLEB with the diagonal bridge, 16K tokens, one seed) it cut the peak
            memory by 30% and the time by 9%, for a model 0.3% behind on both texts. None (the default) trains
            them, as every published row did, unless the default mode's memory check (`recovery.footprint`, which
            counts only what is trained) finds that `full` fits only with them frozen: then `full` trains with them
            frozen rather than falling back to `local`, which trailed `full` at every budget measured, and the log
            says so. True trains them whatever the memory; False never does.
        temperature: T of the distillation KL (scaled by T²; see `recovery.distill`).
        kd_alpha: Weight of KL(teacher ‖ student); the LM loss gets 1 - kd_alpha. Used only with a teacher.
        hidden_weight: Weight of the hidden-state terms (each student block against the teacher's state at the end
            of the span it stands for, per the report's plan); 0 turns them off.
        state_loss: How the local mode and the hidden-state terms compare a student state with the teacher's:
            ``pooled`` (the mean square error over the target's mean square) or ``per_token`` (each position's error
            relative to its own state, every position weighed alike, as the per-position norms downstream read it).
        max_tokens: Training token budget; sets max_steps to ceil(max_tokens / (batch × accumulation × seqlen)),
            and the text must hold that many training tokens (no second epoch). None uses max_steps / epochs.
            Global under a data-parallel launch: the batch is per process, so a step reads N times as many.
        eval_every: Steps between held-out evaluations of the gate.
        patience: Evaluations without improvement before stopping early (0: never).
        heldout_rows: Rows of the training text held out for the gate (0 turns the gate off).
        chunk_size: Positions pushed through the LM heads at a time in the loss.
        r, lora_alpha, lora_dropout: LoRA shape (mode='lora').
        learning_rate: The optimiser's rate, used as given; None takes the mode's (`DEFAULT_LEARNING_RATES`), scaled
            for the full-parameter modes by the model's weight scale over `SWEPT_WEIGHT_SCALE` (`rate_for`).
        num_train_epochs, max_steps: Optimisation (max_steps > 0 overrides the epochs).
        per_device_train_batch_size, gradient_accumulation_steps: Batch shape.
        seqlen: Tokens per training row.
        max_samples: Train on at most this many rows (seeded choice); None uses all.
        target_modules: Module names LoRA wraps; None takes every projection the architecture adapter exposes
            (q, k, v, o, gate, up, down; W_pack for Baichuan).
        layers_to_transform: Restrict LoRA to these layer indices of the compressed model (renumbered, 0-based).
        logging_steps, seed: As in TrainingArguments.
        checkpoint_dir: Folder for the healing's checkpoints (`recovery.resume`: one subfolder a Trainer phase, the
            Trainer's checkpoints with the gate's state); None trains in a scratch folder removed afterwards. A run
            started again with the same folder and options continues from its newest complete checkpoint, to the
            weights an uninterrupted run gives (a finished phase is replayed, not trained again); a folder holding
            the checkpoints of a healing with other options is refused.
        save_every: Optimiser steps between checkpoints (0: none, the finished phases are still recorded when
            `checkpoint_dir` is given).
        teacher_text: Share of the training rows sampled from the teacher itself (self-data distillation,
            Thangarasa et al. 2024; `recovery.teacher_text`): 0 trains on the given text only, 1 on the teacher's
            text only (``dataset="teacher"`` says the same, with no text of the user's). The gate's held-out rows
            take the same share, and the log scores each part apart. Needs a teacher.
        teacher_prompt_tokens: With `prompts`, the tokens of each prompt document the teacher continues.
        sampling_temperature, sampling_top_k, sampling_top_p: How the teacher samples: temperature 1 and no top-k
            or top-p cut by default, so that the rows follow the teacher's own distribution (whatever its
            generation_config.json says); see `recovery.teacher_text`.
        sampling_batch_size: Rows generated at a time; None: 64 on a CPU, sized to the free memory on CUDA.
        sampling_backend: Who samples: ``"transformers"`` (``generate``), or ``"vllm"`` where it is installed
            (faster on a GPU; the teacher is loaded again from its path in a child process, `recovery.vllm_sampling`).
        teacher_text_cache: Folder the teacher's rows are kept in, so that a resumed healing reads them back instead
            of sampling again; None: ``<checkpoint_dir>/teacher_text`` when `checkpoint_dir` is set, else none.
        prompts: Documents whose first `teacher_prompt_tokens` tokens start the teacher's rows (a file with one
            prompt a line, or any text source `calibration.data.load_texts` reads); None starts every row from the
            tokenizer's BOS token (its EOS without one).
        sampling_start: ``"bos"`` starts each row from the BOS token (then the prompt, if any); ``"chat"`` from the
            tokenizer's chat template, a user turn holding the prompt (empty without one) and the assistant's turn
            opened, so that an instruct model writes what it writes as an assistant rather than from a bare token
            it was not tuned to continue; ``"random"`` from the BOS token and a first token drawn uniformly from the
            ordinary vocabulary for each row (LLM-QAT's data-free start; no prompts) (see `recovery.teacher_text`).
        teacher_text_loops: ``"train"`` trains on every token of the teacher's text; ``"mask"`` leaves out of the
            loss each token that repeats a 4-gram earlier in its row (`recovery.text_repetition`): the loop stays as
            context, but the student is not taught to continue it. For a teacher whose own text loops (the bundled
            Qwen2.5-Coder's: about half its tokens); the held-out rows are masked alike, so the gate scores what
            trains.
        guard_text: A text the healing must not make worse (a file or any source `load_recovery_texts` reads):
            `heldout_rows` rows of it, never trained on, are scored at every evaluation of the gate, which keeps a
            trained state only where their objective is no higher than the input's (`recovery.gate`). None guards a
            mix (0 < `teacher_text` < 1) with the user's own held-out rows, and nothing else.
    """

    mode: Literal["lora", "changed", "local", "last_k", "full"] | None = field(
        default=None,
        metadata={
            "default": "full with a teacher where it fits (after a plan that merged layers: local, then the global "
            "loss, half the budget each), else local on one process, else lora (default_mode, local_then_global)"
        },
    )
    local_then_global_tokens: int | None = None
    global_scope: Literal["spans", "all"] = "spans"
    global_learning_rate: float | None = field(
        default=None, metadata={"default": "learning_rate if given, else the global scope's mode's default, scaled"}
    )
    last_k: int = 3
    train_embeddings: bool | None = field(
        default=None,
        metadata={"default": "trained, unless the default mode's memory check fits full only with them frozen"},
    )
    temperature: float = 1.0
    kd_alpha: float = 1.0
    hidden_weight: float = 0.0
    state_loss: Literal["pooled", "per_token"] = "pooled"
    max_tokens: int | None = None
    eval_every: int = 20
    patience: int = 3
    heldout_rows: int = 8
    chunk_size: int = 128
    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    learning_rate: float | None = field(
        default=None, metadata={"default": "the mode's, scaled to the model's weights (rate_for)"}
    )
    num_train_epochs: float = 2.0
    max_steps: int = -1
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    seqlen: int = 256
    max_samples: int | None = None
    target_modules: list[str] | None = None
    layers_to_transform: list[int] | None = None
    logging_steps: int = 10
    seed: int = 0
    checkpoint_dir: str | None = None
    save_every: int = 0
    teacher_text: float = 0.0
    teacher_prompt_tokens: int = 32
    sampling_temperature: float = 1.0
    sampling_top_k: int | None = field(default=None, metadata={"default": "no top-k cut"})
    sampling_top_p: float | None = field(default=None, metadata={"default": "no top-p cut"})
    sampling_batch_size: int | None = field(
        default=None, metadata={"default": "64 on a CPU, the free memory's on CUDA"}
    )
    sampling_backend: Literal["transformers", "vllm"] = "transformers"
    teacher_text_cache: str | None = field(default=None, metadata={"default": "<checkpoint_dir>/teacher_text if set"})
    prompts: str | None = field(default=None, metadata={"default": "the BOS token (EOS without one)"})
    sampling_start: Literal["bos", "chat", "random"] = "bos"
    teacher_text_loops: Literal["train", "mask"] = "train"
    guard_text: str | None = field(default=None, metadata={"default": "in a mix, the user's held-out rows; else none"})
    extra_training_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuses sampling options out of range when the config is made (one line each), before any model loads."""
        share = self.teacher_text
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"teacher_text is the share of teacher-sampled training rows, in [0, 1]; got {share!r}.")
        if not (math.isfinite(self.sampling_temperature) and self.sampling_temperature > 0):
            raise ValueError(f"sampling_temperature must be a positive number, got {self.sampling_temperature}.")
        if self.sampling_top_k is not None and self.sampling_top_k < 0:
            raise ValueError(f"sampling_top_k must be at least 0 (0 or None: no cut), got {self.sampling_top_k}.")
        if self.sampling_top_p is not None and not 0.0 < self.sampling_top_p <= 1.0:
            raise ValueError(f"sampling_top_p must be in (0, 1] (1 or None: no cut), got {self.sampling_top_p}.")
        if self.sampling_batch_size is not None and self.sampling_batch_size < 1:
            raise ValueError(f"sampling_batch_size must be at least 1 row, got {self.sampling_batch_size}.")
        if self.sampling_backend not in ("transformers", "vllm"):
            raise ValueError(f"sampling_backend is 'transformers' or 'vllm', got {self.sampling_backend!r}.")
        if self.sampling_start not in ("bos", "chat", "random"):
            raise ValueError(f"sampling_start is 'bos', 'chat' or 'random', got {self.sampling_start!r}.")
        if self.teacher_text_loops not in ("train", "mask"):
            raise ValueError(f"teacher_text_loops is 'train' or 'mask', got {self.teacher_text_loops!r}.")
        if self.teacher_prompt_tokens < 1:
            raise ValueError(f"teacher_prompt_tokens must be at least 1, got {self.teacher_prompt_tokens}.")
        for name in ("last_k", "per_device_train_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}.")
        self._check_budget()
        self._check_training_options()
        self._check_lora_options()
        if self.mode == "lora" and self.train_embeddings:
            raise ValueError(
                "mode 'lora' trains adapters on the projections only, so train_embeddings=True would do nothing; it "
                "applies to modes 'full' and 'last_k' and to mode 'local''s global phase."
            )

    def _check_training_options(self) -> None:
        """Refuses a loss, gate or optimiser option out of range when the config is made: the losses, the gate and
        the Trainer would each refuse it only once the healing starts, after a compression asked to heal had
        changed the weights."""
        positive = {"temperature": self.temperature, "learning_rate": self.learning_rate}
        positive["global_learning_rate"] = self.global_learning_rate
        for name, value in positive.items():
            if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        if not (_is_number(self.kd_alpha) and 0.0 <= self.kd_alpha <= 1.0):
            raise ValueError(
                f"kd_alpha must be in [0, 1] (the weight of the KL against the LM loss), got {self.kd_alpha!r}."
            )
        if not (_is_number(self.hidden_weight) and math.isfinite(self.hidden_weight) and self.hidden_weight >= 0):
            raise ValueError(f"hidden_weight must be a number of at least 0, got {self.hidden_weight!r}.")
        if not (_is_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0):
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}.")
        for name, least in (("chunk_size", 1), ("eval_every", 1), ("logging_steps", 1), ("r", 1), ("patience", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}.")
        if not (_is_number(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}.")
        if not isinstance(self.extra_training_args, Mapping):
            raise ValueError(
                f"extra_training_args must be a mapping of TrainingArguments fields, got {self.extra_training_args!r}."
            )

    def _check_lora_options(self) -> None:
        """Refuses LoRA's options given to another mode, where nothing reads them: a user who sets a rank or target
        modules means LoRA, and would get every weight trained instead (with several times the memory). The default
        mode (None) is checked once it is chosen (`recovery.lora.check_lora_targets`): without a teacher it is
        LoRA."""
        if self.mode is not None:
            check_lora_options(self, f"mode {self.mode!r}")

    def _check_budget(self) -> None:
        """Refuses a row that scores nothing, a budget that trains nothing, and two budgets that disagree (one of
        them was silently ignored: max_tokens sets the steps)."""
        if self.seqlen < 2:
            raise ValueError(
                f"seqlen must be at least 2 (a row trains each token on those before it), got {self.seqlen}."
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(
                f"max_steps must be a positive number of steps, or -1 (the epochs decide), got {self.max_steps}."
            )
        if not (math.isfinite(self.num_train_epochs) and self.num_train_epochs > 0):
            raise ValueError(f"num_train_epochs must be a positive number, got {self.num_train_epochs}.")
        if self.max_tokens is not None and self.max_steps > 0:
            raise ValueError(
                f"give max_tokens ({self.max_tokens}) or max_steps ({self.max_steps}), not both: the token budget sets "
                "the steps."
            )
        if self.heldout_rows < 0:
            raise ValueError(f"heldout_rows must be at least 0 (0 turns the gate off), got {self.heldout_rows}.")

    @property
    def trains_embeddings(self) -> bool:
        """Whether the token embeddings and the LM head are trained (None counts as trained until the memory check
        resolves it, `recovery.footprint.ModeChoice`)."""
        return self.train_embeddings is not False

    @property
    def rate(self) -> float:
        """The learning rate given, or the mode's default at `SWEPT_WEIGHT_SCALE` (the mode resolved, see
        `default_mode`); `rate_for` is the one a model trains at."""
        if self.learning_rate is not None:
            return self.learning_rate
        if self.mode is None:
            raise ValueError("the default learning rate follows the mode; resolve it first (default_mode).")
        return DEFAULT_LEARNING_RATES[self.mode]

    def rate_for(self, weight_scale: float) -> float:
        """The learning rate for a model whose weight matrices have median root-mean-square entry `weight_scale`
        (`recovery.rate.weight_scale`): the one given as it is; else the mode's default, times
        weight_scale / `SWEPT_WEIGHT_SCALE` for the modes of `WEIGHT_SCALED_MODES`, so that a default step is the
        same share of each model's weights as where it was chosen."""
        if self.learning_rate is not None or self.mode not in WEIGHT_SCALED_MODES:
            return self.rate
        if not math.isfinite(weight_scale) or weight_scale <= 0:
            raise ValueError(
                f"the model's weight scale must be a positive number to scale the default learning rate, got "
                f"{weight_scale}; give learning_rate=... instead."
            )
        return self.rate * weight_scale / SWEPT_WEIGHT_SCALE

    def rows_per_step(self) -> int:
        """Training rows one optimiser step reads (one device): the batch times the accumulation."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def tokens_per_step(self) -> int:
        """Training tokens one optimiser step reads (one device)."""
        return self.rows_per_step() * self.seqlen


def default_mode(has_teacher: bool, has_plan: bool, processes: int, fsdp: bool = False, full_fits: bool = False) -> str:
    """The mode `RecoveryConfig(mode=None)` trains: ``full`` under FSDP, or with a teacher where its memory fits on
    every rank (`full_fits`, from `recovery.footprint`); else, with a teacher and the compression's plan, ``local`` on
    one process and ``full`` (sharded) on several; else ``lora``.

    Why: `full` came first of the modes at every budget and on every model measured (only `local` followed by a
    global phase beat it, after FlattenGPT: `with_mode`'s `local_then_global`), but it holds the model's gradients
    and optimiser state (about 16 bytes a parameter beside the teacher), so it is the default only where that fits
    (`recovery.footprint.ModeChoice` tries the embeddings frozen and a lean optimiser first). `local` needs the least
    memory but a teacher, the plan and one process (its blocks run outside the model's forward, which a data-parallel
    wrapper would not synchronise); LoRA's memory does not grow with the student either. Under several processes each
    rank checks its own memory and the worst answer wins; where one process would train `local`, they train `full`
    sharded with FSDP2 instead (`sharded_full`), never LoRA silently. FSDP shards what `full` holds and runs neither
    `local` nor LoRA (`recovery.arguments.check_fsdp`).
    The measurements: benchmarks/NOTEBOOK.md, "Healing: distillation from the dense model"; docs/workflows.md.
    """
    if fsdp or (has_teacher and full_fits):
        return "full"
    if has_teacher and has_plan:
        # `local` cannot run across ranks; the nearest mode that can is `full`, sharded (`with_mode` asks for FSDP2).
        return "local" if processes == 1 else "full"
    return "lora"


def merges_layers(plan: Mapping[str, Any] | None) -> bool:
    """Whether a compression's plan (the report's ``plan``) merged layers: a group of two or more kept as one block."""
    return bool(plan) and any(len(group) > 1 for group in plan.get("groups", []))


#: How the log and the model card say that `local_then_global` changed a default `full`.
SPLIT_AFTER_MERGES = "the plan merged layers: local, then the global loss, half the budget each"


def local_then_global(config: RecoveryConfig) -> RecoveryConfig:
    """`full` chosen by default after a compression that merged layers becomes `local` for half the token budget,
    then the global loss on the same blocks for the other half (`local_then_global_tokens`).

    Why: after a merge, the merged blocks start far from what they replace, and a phase that trains each one alone
    towards the dense model's state first beat `full` after FlattenGPT, on both texts on SmolLM2-135M and out of
    domain on Qwen2.5-0.5B (level in domain), at less time and memory; training the same blocks in the global phase,
    not every weight, was within 0.02 on SmolLM2 and ahead out of domain on Qwen2.5. After ReplaceMe, whose one
    bridged block leaves the local phase little to fix, `full` stayed ahead, so a plan without merged blocks keeps
    it; so does a budget given as epochs (there is no budget to split). The rows, and the seeds that bound how far
    they can be read: benchmarks/NOTEBOOK.md, "Healing" (`local` then the global loss)."""
    if config.mode != "full" or config.max_tokens is None or config.local_then_global_tokens is not None:
        return config
    global_tokens = config.max_tokens // 2
    if global_tokens < 1:
        return config
    return dataclasses.replace(
        config, mode="local", max_tokens=config.max_tokens - global_tokens, local_then_global_tokens=global_tokens
    )


def with_mode(
    config: RecoveryConfig,
    has_teacher: bool,
    has_plan: bool,
    processes: int | None = None,
    fsdp: bool = False,
    full_fits: Callable[[], bool] | None = None,
    merged: bool = False,
) -> RecoveryConfig:
    """`config` with its mode resolved (`default_mode` when None); `processes` None reads the launchers'
    ``WORLD_SIZE`` (torchrun, accelerate launch), as the Trainer will. `full_fits` answers whether `full`'s memory
    fits; it is asked only when the answer can change the mode (a teacher, one process, no FSDP). `merged`: the plan
    merged layers (`merges_layers`), where a default `full` becomes `local_then_global`."""
    if config.mode is not None:
        return config
    if processes is None:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
    fits = has_teacher and not fsdp and full_fits is not None and full_fits()
    resolved = dataclasses.replace(config, mode=default_mode(has_teacher, has_plan, processes, fsdp, fits))
    if processes > 1 and resolved.mode == "full" and not fsdp and not fits:
        return sharded_full(resolved)
    return local_then_global(resolved) if merged and has_plan and not fsdp and processes == 1 else resolved


#: The training arguments that shard `full` across the ranks (FSDP2, the version healing supports).
FSDP2_ARGS: dict[str, Any] = {"fsdp": True, "fsdp_config": {"version": 2}}

#: How the log and the model card say that a launch of several processes sharded a default `full`.
SHARDED_ACROSS_RANKS = (
    "several processes, and full does not fit one rank: full, sharded with FSDP2 across them (local, which one "
    "process would train, cannot run across ranks)"
)


def sharded_full(config: RecoveryConfig) -> RecoveryConfig:
    """`config` (mode `full`) with FSDP2 asked of the Trainer, unless its own training arguments say otherwise:
    where one rank cannot hold `full`'s gradients and optimiser state, the ranks hold a share each."""
    return dataclasses.replace(config, extra_training_args={**FSDP2_ARGS, **config.extra_training_args})


#: Keys a ``heal`` mapping may hold besides `RecoveryConfig`'s fields.
HEAL_EXTRA_KEYS = ("dataset", "text_column")
#: The fields only mode 'lora' reads.
LORA_OPTIONS = ("r", "lora_alpha", "lora_dropout", "target_modules", "layers_to_transform")


def _is_number(value: Any) -> bool:
    """An int or float that is not a bool (True would pass for 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_lora_options(config: RecoveryConfig, mode: str) -> None:
    """Refuses `LORA_OPTIONS` set to other than their defaults when `config.mode` is not 'lora' (`mode` names it)."""
    if config.mode == "lora":
        return
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.name in LORA_OPTIONS}
    given = [name for name in LORA_OPTIONS if getattr(config, name) != defaults[name]]
    if given:
        one = len(given) == 1
        raise ValueError(
            f"{', '.join(given)} {'is an option' if one else 'are options'} of mode 'lora', and {mode} would ignore "
            f"{'it' if one else 'them'}: pass mode='lora' (--mode lora), or leave {'it' if one else 'them'} out."
        )


def parse_heal(heal: Any) -> dict[str, Any] | None:
    """``FlattenConfig(heal=...)`` read and checked when the config is made (before any weight changes).

    ``None`` heals nothing; an integer is a training-token budget with `RecoveryConfig`'s other defaults; a mapping
    holds `RecoveryConfig` fields plus ``dataset`` (the training text; default: the calibration dataset) and
    ``text_column``. The teacher is always the dense model being compressed, so there is no ``teacher`` key.

    Returns:
        None, or a plain dict (JSON-serialisable apart from a dataset object) with ``max_tokens`` set.

    Raises:
        TypeError: an unknown key (with a did-you-mean).
        ValueError: a budget that is not a positive integer, or a field value its type hint does not admit.
    """
    if heal is None:
        return None
    if isinstance(heal, bool) or not isinstance(heal, (int, Mapping)):
        raise ValueError(
            f"heal must be a number of training tokens (e.g. heal=262144) or a mapping of RecoveryConfig fields, "
            f"got {heal!r}."
        )
    options = {"max_tokens": heal} if isinstance(heal, int) else dict(heal)
    fields = [f.name for f in dataclasses.fields(RecoveryConfig)]
    reject_unknown_keys(options, [*fields, *HEAL_EXTRA_KEYS], "heal")
    settings = {k: v for k, v in options.items() if k in fields}
    check_option_types(RecoveryConfig, settings)
    budget = options.get("max_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"heal needs a positive training-token budget (max_tokens), got {budget!r}.")
    RecoveryConfig(**settings)
    from ..utils.loading import check_not_a_description

    check_not_a_description(
        options.get("dataset"),
        "heal's dataset",
        "FlattenConfig.from_dict(saved, heal={**saved['heal'], 'dataset': texts})",
    )
    return options
