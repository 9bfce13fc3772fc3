"""What whole-model healing (``mode='full'``) holds beyond the weights already loaded, so that the default mode can be
`full` where it fits (with the embeddings frozen where only that fits, `ModeChoice`) and `local` where it does not
(`options.recovery.default_mode`).

`full` was the best mode at every budget measured (benchmarks/recovery: SmolLM2-135M after FlattenGPT and after
ReplaceMe, Qwen2.5-0.5B after ReplaceMe, where `local` never beat its input), but it holds the whole student's
gradients and optimiser state: 3 times the trained weights and more (at LLaMA-2-7B shape in bfloat16, 30 GiB above
the 22 GiB of teacher and student, measured on an H200). The bound here is meant to be safe rather than tight, since a
wrong "fits" fails a run mid-way and a wrong "does not fit" only picks the second-best mode:

- the trained weights' gradients and Adam's two moments (3 × their bytes, in their dtype, as torch keeps them), the
  gate's copy of the best state (1 ×, on the host) and the optimiser step's temporaries and the allocator's slack
  (4 ×): ``STATE_FACTOR`` = 8 times the trained weights in host memory. Measured as peak resident memory above what
  was loaded (benchmarks/recovery/footprint.py): 7.0 × on SmolLM2-135M in float32, 4.5 × on Qwen2.5-0.5B in bfloat16.
  On a CUDA device the gate's copy is not on the device and the caching allocator's peak has no resident-memory
  slack: ``ACCELERATOR_STATE_FACTOR`` = 4 (measured 3.0 × at LLaMA-2-7B shape, benchmarks/cost/heal_shape.py);
- activations kept for the backward pass, per token and layer ``16·hidden + 4·intermediate + 2·heads·seqlen``
  elements (the residual stream's norms, projections and their inputs; the MLP's up, gate and activation; attention's
  probabilities, only with eager attention: SDPA and flash kernels recompute them), at the weights' dtype. At
  LLaMA-2-7B shape with SDPA, 4 rows of 2048 tokens measured 58 GiB reserved against this bound's 81;
- the loss's chunk of positions through both LM heads (`distill.chunked_next_token_terms`, `chunk_size` positions at
  a time, float32): the student's and the teacher's logits, their log-softmaxes, the KL's product and, in the
  backward's recomputation, the logits' gradient: ``LOSS_CHUNK_COPIES``·chunk·vocabulary·4 bytes, which a large
  vocabulary beside a small hidden size makes count (SmolLM2, Qwen2.5);
- the teacher's weights when it is still to be loaded;
- with teacher text (`RecoveryConfig.teacher_text`), one sampling batch's KV cache and next-token logits
  (`recovery.teacher_text`), held before training starts, so it counts against the training state, not beside it (the
  student's depth stands for the teacher's here; on CUDA the sampling batch is sized to the free memory anyway).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..options.recovery import SHARDED_ACROSS_RANKS, SPLIT_AFTER_MERGES, RecoveryConfig
from ..plan import LayerPlan
from ..utils.launch import all_ranks_max, processes_on_this_host
from ..utils.memory import available_bytes
from .selection import embedding_tables

logger = logging.getLogger(__name__)


def _variant(optim: str | None, train_embeddings: bool | None) -> str:
    """How the log names a fallback of `ModeChoice.candidates`: ``with the token embeddings and the LM head frozen``,
    ``with adafactor``, or both."""
    parts = ([optim] if optim else []) + (
        ["the token embeddings and the LM head frozen"] if train_embeddings is False else []
    )
    return "with " + " and ".join(parts)


#: Bytes held beside the trained weights per byte of them where the peak is the process's resident memory (a CPU):
#: gradients, Adam's moments, the gate's copy, temporaries and the allocator's slack.
STATE_FACTOR = 8
#: The same on a CUDA device, where the peak is the caching allocator's: gradients and AdamW's two moments, and one
#: more for the optimiser step's temporaries and the allocator's fragmentation. The gate keeps its copy of the best
#: state in host memory, not on the device. Measured at LLaMA-2-7B shape in bfloat16 on an H200: 3.0x the trained
#: weights with AdamW, 1.2x with Adafactor (benchmarks/cost/heal_shape.py; NOTEBOOK.md, "Healing at 7B").
ACCELERATOR_STATE_FACTOR = 4
#: The part of `STATE_FACTOR` that is AdamW's two moments (at the weights' dtype); another optimiser replaces it.
ADAM_MOMENTS = 2
#: Optimisers of the Trainer's own list (`TrainingArguments.optim`) that `full` may fall back to where AdamW's state
#: does not fit, in order of preference, with their state per trained parameter in bytes: bitsandbytes' 8-bit AdamW
#: keeps two 1-byte moments (it needs CUDA and bitsandbytes); Adafactor (without a first moment, the Trainer's
#: setting) keeps a row and a column of second moments per matrix, nothing that grows with the matrix.
LEAN_OPTIMISERS: dict[str, float] = {"adamw_bnb_8bit": 2.0, "adafactor": 0.0}
#: Share of the free memory the estimate may take before `full` is said not to fit.
HEADROOM = 0.9


#: Float32 copies of one loss chunk's logits alive at once (module docstring).
LOSS_CHUNK_COPIES = 6


@dataclass(frozen=True)
class FullFootprint:
    """Bytes `mode='full'` adds to what is resident when training starts.

    Attributes:
        state: Gradients, optimiser moments, the gate's best-state copy and the step's temporaries.
        activations: What one step's forward keeps for its backward pass.
        teacher: The teacher's weights still to be loaded (0 when it is given loaded).
        sampling: One batch of the teacher's text sampling (0 without teacher text): freed before training.
    """

    state: int
    activations: int
    teacher: int
    sampling: int = 0

    @property
    def total(self) -> int:
        return max(self.state + self.activations, self.sampling) + self.teacher

    def fits(self, available: int) -> bool:
        """Whether the footprint takes at most `HEADROOM` of `available` bytes."""
        return self.total <= HEADROOM * available

    def describe(self) -> str:
        gib = 2**30
        return (
            f"full healing adds about {self.total / gib:.1f} GiB (training state {self.state / gib:.1f}, activations "
            f"{self.activations / gib:.1f}, teacher {self.teacher / gib:.1f}"
            + (f"; sampling the teacher's text first {self.sampling / gib:.1f})" if self.sampling else ")")
        )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's floating-point parameters, each tied tensor once (what training states are sized by)."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique if p.is_floating_point())


def embedding_bytes(model: nn.Module) -> int:
    """Bytes of the token embeddings and the LM head, a tied table once (what `train_embeddings=False` leaves
    untrained, so holds no gradient or optimiser state for)."""
    return sum(t.numel() * t.element_size() for t in embedding_tables(model))


def full_footprint(
    student: nn.Module, config: RecoveryConfig, teacher_bytes: int = 0, accelerator: bool | None = None
) -> FullFootprint:
    """The upper estimate of what training every parameter of `student` with `config`'s batch adds (module docstring).

    Args:
        student: The model to be healed (its parameters' dtype is the state's).
        config: The batch shape (rows per device, accumulation, seqlen), and whether the embeddings are trained.
        teacher_bytes: Bytes of a teacher not loaded yet (0: already resident, or none).
        accelerator: Whether it trains on a CUDA device (`ACCELERATOR_STATE_FACTOR`) rather than in host memory
            (`STATE_FACTOR`); None: where the student's parameters are.
    """
    weights = weight_bytes(student) - (0 if config.trains_embeddings else embedding_bytes(student))
    parameter = next((p for p in student.parameters() if p.is_floating_point()), None)
    element = parameter.element_size() if parameter is not None else 4
    if accelerator is None:
        accelerator = parameter is not None and parameter.device.type == "cuda"
    state_factor = optimiser_state_factor(
        str(config.extra_training_args.get("optim", "adamw_torch")),
        element,
        ACCELERATOR_STATE_FACTOR if accelerator else STATE_FACTOR,
    )
    text = student.config.get_text_config()
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    heads = int(text.num_attention_heads)
    per_token_layer = 16 * hidden + 4 * intermediate
    if getattr(text, "_attn_implementation", None) in (None, "eager"):  # SDPA and flash kernels keep no probabilities
        per_token_layer += 2 * heads * config.seqlen
    tokens = config.per_device_train_batch_size * config.seqlen
    activations = tokens * int(text.num_hidden_layers) * per_token_layer * element
    activations += LOSS_CHUNK_COPIES * config.chunk_size * int(text.vocab_size) * 4
    sampling = sampling_bytes(student, config) if config.teacher_text > 0 else 0
    return FullFootprint(math.ceil(state_factor * weights), activations, int(teacher_bytes), sampling)


def optimiser_state_factor(optim: str, element: int, adamw_factor: float = STATE_FACTOR) -> float:
    """The state factor (`adamw_factor`: `STATE_FACTOR` or `ACCELERATOR_STATE_FACTOR`, both AdamW's) for the
    Trainer's optimiser `optim` (AdamW's unless it is one of `LEAN_OPTIMISERS`), per byte of trained weights of
    `element` bytes each."""
    if optim not in LEAN_OPTIMISERS:
        return float(adamw_factor)
    return adamw_factor - ADAM_MOMENTS + LEAN_OPTIMISERS[optim] / element


def lean_optimisers() -> list[str]:
    """The `LEAN_OPTIMISERS` this machine can run: 8-bit AdamW only with CUDA and bitsandbytes installed."""
    import importlib.util

    import torch

    usable = torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None
    return [name for name in LEAN_OPTIMISERS if name != "adamw_bnb_8bit" or usable]


def sampling_bytes(model: nn.Module, config: RecoveryConfig) -> int:
    """One sampling batch of the teacher's text (`recovery.teacher_text`): its rows' KV caches at `seqlen` and their
    next-token logits, at the configured batch or the CPU default (`model`'s config stands for the teacher's). Zero
    with vLLM: it samples in its own process, with a share of what is free then, and gives it back before training."""
    from .teacher_text import CPU_BATCH_SIZE, LOGIT_BYTES, kv_cache_bytes

    if config.sampling_backend == "vllm":
        return 0

    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    rows = config.sampling_batch_size or CPU_BATCH_SIZE
    vocab = int(model.config.get_text_config().vocab_size)
    return rows * (kv_cache_bytes(model.config, config.seqlen, element) + LOGIT_BYTES * vocab)


def full_candidates(config: RecoveryConfig, optimisers: list[str]) -> list[tuple[str | None, bool | None]]:
    """(optimiser, train_embeddings) to try for `full`, best first: as asked; then, each only where the user left
    it to the default, the embeddings frozen, a lean optimiser of `optimisers`, and both."""
    optimisers_tried = [None] + ([] if "optim" in config.extra_training_args else list(optimisers))
    embeddings = [config.train_embeddings] + ([False] if config.train_embeddings is None else [])
    return [(optim, train) for optim in optimisers_tried for train in embeddings]


def candidate_footprints(
    student: nn.Module, config: RecoveryConfig, teacher_bytes: int = 0, accelerator: bool | None = None
) -> list[tuple[str, FullFootprint]]:
    """`full_footprint` of every candidate the default mode tries, in its order, with every lean optimiser whether
    this machine could run it or not (an estimate is read for another machine): (how the log names it, footprint)."""
    named = []
    for optim, train in full_candidates(config, list(LEAN_OPTIMISERS)):
        extra = {**config.extra_training_args, **({"optim": optim} if optim else {})}
        variant = dataclasses.replace(config, train_embeddings=train, extra_training_args=extra)
        name = "as asked" if optim is None and train == config.train_embeddings else _variant(optim, train)
        named.append((name, full_footprint(student, variant, teacher_bytes, accelerator)))
    return named


def teacher_bytes_to_load(
    student: nn.Module, teacher: Any, report: Mapping[str, Any] | None, device: torch.device | None = None
) -> int:
    """Bytes of the teacher `recover` will still load onto the training `device`: for a loaded model, 0 where it is
    on that device already (resident), its weights where `recover` moves it there; else the student's weights scaled
    by the plan's original over kept layers (an upper estimate: the embeddings do not grow), or twice the student's
    weights without a plan."""
    if isinstance(teacher, nn.Module):
        elsewhere = device is not None and next(teacher.parameters()).device != device
        return weight_bytes(teacher) if elsewhere else 0
    weights = weight_bytes(student)
    plan = (report or {}).get("plan")
    if not plan:
        return 2 * weights
    layer_plan = LayerPlan.from_dict(plan)
    return math.ceil(weights * layer_plan.num_layers / max(1, layer_plan.num_output_layers))


def training_device(student: nn.Module, config: RecoveryConfig) -> torch.device:
    """The device the Trainer trains `student` on, whose free memory `full` must fit: where its weights are, unless
    they sit in host memory on a machine with CUDA and the run does not ask for the CPU (``use_cpu``). The Trainer then
    moves the model onto this process's GPU (``LOCAL_RANK``'s under a launch), as it does for a model that
    ``optimum-flatten recover`` loaded on the CPU; a model dispatched over devices (``hf_device_map``) stays put."""
    device = next(student.parameters()).device
    extra = config.extra_training_args
    stays = device.type != "cpu" or getattr(student, "hf_device_map", None) or extra.get("use_cpu")
    return device if stays else host_training_device()


def host_training_device() -> torch.device:
    """Where the Trainer trains a model held in host memory: this process's GPU (``LOCAL_RANK``'s under a launch)
    where CUDA exists, else the CPU (`training_device`; `estimate --heal` asks it for a model not loaded yet)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


@dataclass(frozen=True)
class Budget:
    """The memory a mode choice is given instead of reading it: what `estimate --heal` asks for a device and a
    free memory that need not be this process's, so that it answers with the very check `compress` runs.

    Attributes:
        free: Bytes free on the device the healing trains on, the student's weights already there (what the choice
            reads there once the model is loaded, or reads less the weights the Trainer moves in).
        accelerator: Whether that device is a CUDA GPU (`ACCELERATOR_STATE_FACTOR`) rather than host memory.
        optimisers: The `LEAN_OPTIMISERS` the device can run, in their order.
        where: How the memory line names the device.
    """

    free: int
    accelerator: bool
    optimisers: tuple[str, ...]
    where: str


def check_full(
    student: nn.Module, config: RecoveryConfig, teacher_bytes: int, available: int | None, budget: Budget | None = None
) -> tuple[FullFootprint, bool, str]:
    """(`full_footprint`, whether it fits, the line saying so): on the device the student trains on
    (`training_device`; `available` bytes free there, read now when None), with its weights where the Trainer moves
    them there; or within `budget` where one is given (nothing read, nothing moved)."""
    if budget is None:
        device = training_device(student, config)
        accelerator, where = device.type == "cuda", str(device)
        free = available_bytes(device) if available is None else available
        # Weights the Trainer moves onto `device` take their share of its free memory first.
        moved = weight_bytes(student) if device != next(student.parameters()).device else 0
    else:
        accelerator, where, free, moved = budget.accelerator, budget.where, budget.free, 0
    footprint = full_footprint(student, config, teacher_bytes, accelerator)
    fits = footprint.fits(free - moved)
    line = (
        f"{footprint.describe()}; {free / 2**30:.1f} GiB free on {where}"
        + (f", {moved / 2**30:.1f} of it for the student's weights moved there" if moved else "")
        + f": {'fits' if fits else 'does not fit'} within {HEADROOM:.0%} of it"
    )
    logger.info(line)
    return footprint, fits, line


def full_fits(
    student: nn.Module, config: RecoveryConfig, teacher_bytes: int, available: int | None = None
) -> tuple[bool, str]:
    """Whether `full_footprint` fits the free memory of the device the student trains on, and a line saying so
    (logged, and kept in the healing's log, since the default mode follows it): `check_full` without its footprint."""
    _, fits, line = check_full(student, config, teacher_bytes, available)
    return fits, line


class ModeChoice:
    """How a healing's mode was chosen: given, or the default and the memory check behind it. Passed to
    `options.recovery.with_mode` as its `full_fits`, which asks it only when the answer can change the mode.

    With a `budget` the free memory, the device's kind and its optimisers are given rather than read here: what
    `estimate --heal` asks, so that the estimate and the run make one check (`mode.compress_heal_mode`)."""

    def __init__(
        self,
        student: nn.Module,
        config: RecoveryConfig,
        teacher_bytes: Callable[[], int],
        budget: Budget | None = None,
    ) -> None:
        self.student, self.config, self.teacher_bytes, self.budget = student, config, teacher_bytes, budget
        self.line: str | None = None
        #: Set when `full` fits only with the embeddings frozen (`train_embeddings` left to None): `apply` freezes
        #: them, since `full` led every other mode measured and freezing them changed the model little.
        self.freezes_embeddings = False
        #: Set when `full` fits only with a memory-lean optimiser (`LEAN_OPTIMISERS`, the optimiser left to the
        #: default): `apply` asks the Trainer for it, rather than falling back to a mode that trains less.
        self.optimiser: str | None = None
        #: The footprint of the candidate chosen (None until asked, or where none fits): what `full` will hold.
        self.footprint: FullFootprint | None = None

    def candidates(self) -> list[tuple[str | None, bool | None]]:
        """`full_candidates` with the lean optimisers this machine (or the `budget`'s device) can run."""
        optimisers = lean_optimisers() if self.budget is None else list(self.budget.optimisers)
        return full_candidates(self.config, optimisers)

    def _candidate(self, optim: str | None, train: bool | None) -> RecoveryConfig:
        extra = {**self.config.extra_training_args, **({"optim": optim} if optim else {})}
        return dataclasses.replace(self.config, train_embeddings=train, extra_training_args=extra)

    def __call__(self) -> bool:
        """Whether `full` fits with one of the `candidates`, on every rank of a launch of several processes (each
        checks its own device and the ranks take the worst answer, so that they train one mode together)."""
        teacher = self.teacher_bytes()
        available, sharing = None, 1
        if self.budget is None:
            device = training_device(self.student, self.config)
            available = available_bytes(device)  # read once for every check
            sharing = processes_on_this_host() if device.type == "cpu" else 1
            available //= sharing  # each rank of a CPU launch trains its own copy in the host's one memory
        candidates = self.candidates()
        lines, chosen, footprint = [], len(candidates), None
        for index, (optim, train) in enumerate(candidates):
            footprint, fits, line = check_full(
                self.student, self._candidate(optim, train), teacher, available, self.budget
            )
            lines.append(line if index == 0 else f"{_variant(optim, train)}, {line}")
            if fits:
                chosen = index
                break
        self.line = "; ".join(lines)
        if sharing > 1:
            self.line += f" (this rank's share of the host's memory: {sharing} processes on it)"
        agreed = all_ranks_max(chosen)  # the worst rank's choice: the leanest candidate any rank needs
        if agreed > chosen:
            self.line = f"{self.line}; another rank has less memory"
        if agreed == len(candidates):
            return False
        optim, train = candidates[agreed]
        if agreed != chosen:  # another rank's leaner candidate: its footprint here
            footprint = check_full(self.student, self._candidate(optim, train), teacher, available, self.budget)[0]
        self.footprint = footprint
        self.optimiser = optim
        self.freezes_embeddings = train is False and self.config.train_embeddings is None
        return True

    def apply(self, config: RecoveryConfig) -> RecoveryConfig:
        """`config` (as `with_mode` resolved it) with the embeddings frozen and the lean optimiser where the memory
        check chose them."""
        if self.freezes_embeddings:
            config = dataclasses.replace(config, train_embeddings=False)
        if self.optimiser is not None:
            config = dataclasses.replace(
                config, extra_training_args={**config.extra_training_args, "optim": self.optimiser}
            )
        return config

    def describe(self, resolved: RecoveryConfig | None = None) -> str:
        """``given``, ``the default`` or ``the default (<the memory check>)``, for the log and the model card; with
        the `resolved` config, what a plan that merged layers made of a default `full` (`local_then_global`)."""
        if self.config.mode is not None:
            return "given"
        chosen = "the default" if self.line is None else f"the default ({self.line})"
        if resolved is not None and resolved.mode == "full" and resolved.extra_training_args.get("fsdp"):
            if self.config.extra_training_args.get("fsdp") is None:
                chosen += f"; {SHARDED_ACROSS_RANKS}"
        if resolved is not None and resolved.mode == "local" and resolved.local_then_global_tokens is not None:
            chosen += f"; {SPLIT_AFTER_MERGES}"
        return chosen
