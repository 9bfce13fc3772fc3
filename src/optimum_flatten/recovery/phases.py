"""The phases of a healing (`run_phases`): one Trainer run each (`_train_phase`), with the healing loss as the
Trainer's loss (`distillation_trainer`), the held-out gate as its callback, and a record that a resumed healing
replays (`recovery.resume`) instead of training a finished phase again. `recover` runs one phase, or two for `local`
followed by the global loss; a new phase is one more `_train_phase` in `run_phases`, with its own `index` (and
checkpoint folder) and its entry in `record`."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..options.recovery import RecoveryConfig
from .arguments import _global_phase
from .distill import Objective
from .distillation_trainer import _distillation_trainer_class, _Rows
from .resume import CheckpointState, latest_checkpoint, phase_folder, read_checkpoint, read_phase, save_phase
from .selection import freeze_all_but_, without_embeddings

if TYPE_CHECKING:
    from .healing_run import HealingRun

logger = logging.getLogger(__name__)


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
    guard: list[dict[str, torch.Tensor]] | None = None,
    identity: dict[str, Any] | None = None,
) -> _Phase:
    """Trains `model` on `loss` for `arguments.max_steps`, behind a gate scoring `gate_loss`, best state restored.

    With `config.checkpoint_dir` the phase (`index`) trains in its own folder, checkpointed with the gate's state
    (`recovery.resume`): a phase the folder records as finished is replayed from its record, an unfinished one
    continues from its newest complete checkpoint; either only when the folder's job is `identity`."""
    from ..utils.launch import is_writer
    from .gate import trainable_state

    folder = phase_folder(config, index) if config.checkpoint_dir else None
    if folder is not None and (done := read_phase(folder, config, identity)) is not None:
        return _replayed_phase(model, *done)
    checkpoint = latest_checkpoint(folder) if folder is not None else None
    saved = read_checkpoint(checkpoint, config, identity) if checkpoint is not None else None
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
            guard=guard,
        )
        trainer.add_callback(gate)
    clock = None
    if folder is not None:
        clock = CheckpointState(gate, config, saved["seconds"] if saved is not None else 0.0, is_writer(), identity)
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
        if is_writer():
            save_phase(folder, config, phase.record(), trained, identity)
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


def run_phases(run: HealingRun) -> tuple[list[_Phase], tuple[float, float] | None]:
    """(the phases, mode 'local''s held-out span loss before and after its phase, or None without held-out rows or
    outside mode 'local'): one phase on the healing loss, or in mode 'local' a phase on the span loss and, with
    `local_then_global_tokens`, a global phase on the healing loss (every parameter with `global_scope='all'`).

    Every phase's gate scores the healing loss: the local loss is a proxy (each span on the teacher's input), and
    what must never get worse is the model's own output."""
    from ..utils.launch import is_writer

    config, arguments, rows = run.config, run.schedule.arguments, run.rows
    model, healing_loss, local_loss = run.objectives.trained, run.objectives.healing_loss, run.objectives.local_loss

    def phase(loss: Objective, index: int) -> _Phase:  # every phase gated on the healing loss, checkpointed apart
        guard, identity = rows.guard, run.identity
        return _train_phase(
            model, arguments, rows.train, rows.heldout, loss, healing_loss, config, index, guard, identity
        )

    if local_loss is None:
        return [phase(healing_loss, 1)], None
    model.to(arguments.device)
    local_before = _score(model, local_loss, rows.heldout, config)
    phases = [phase(local_loss, 1)]
    local_after = _score(model, local_loss, rows.heldout, config)
    if run.schedule.global_steps:
        arguments.max_steps = run.schedule.global_steps
        arguments.learning_rate = _global_phase(config).rate_for(run.scale)
        if config.global_scope == "all":
            every = [name for name, _ in model.named_parameters()]
            every = every if config.trains_embeddings else without_embeddings(model, every)
            trainable = freeze_all_but_(model, every)
            if is_writer():
                logger.info("global phase: training every parameter (%d)", trainable)
        phases.append(phase(healing_loss, 2))
    return phases, ((local_before, local_after) if rows.heldout else None)


_NOT_SHARDED = (
    "FSDP was asked for, but accelerate shards only on accelerators (CUDA, XPU, NPU...): this run was "
    "data-parallel (DDP), every process holding the whole model"
)


def note_sharding_(run: HealingRun, first: _Phase) -> None:
    """Notes (and logs) that FSDP was asked for but the Trainer did not shard (on a CPU it runs DDP)."""
    from ..utils.launch import is_writer

    if run.schedule.fsdp is not None and not first.sharded:
        run.notes.append(_NOT_SHARDED)
        if is_writer():
            logger.info(_NOT_SHARDED)
