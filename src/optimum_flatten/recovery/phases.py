"""The phases of a healing (`run_phases`): one Trainer run each (`_train_phase`), with the healing loss as the
Trainer's loss (`distillation_trainer`), the held-out gate as its callback, and a record that a resumed healing
replays (`recovery.resume`) instead of training a finished phase again. `recover` runs one phase, or two for `local`
followed by the global loss; a new phase is one more `_train_phase` in `run_phases`, with its own `index` (and
checkpoint folder) and its entry in `record`."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
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
    model (FSDP), its training seconds (every attempt's, when resumed), the step it was resumed from, its training
    loss over every step (`run_loss`) and the real (unpadded) tokens it trained on over every step and process (None
    for a phase replayed from a record written before they were counted)."""

    result: Any
    history: list[dict[str, Any]]
    gate: Any
    decision: str
    sharded: bool = False
    seconds: float = 0.0
    resumed_from: int | None = None
    train_loss: float | None = None
    tokens: int | None = None

    @property
    def steps(self) -> int:
        return int(self.result.global_step)

    def record(self) -> dict[str, Any]:
        """What a resume needs to replay this phase once it has finished (`recovery.resume.save_phase`)."""
        return {
            "steps": self.steps,
            "train_loss": self.train_loss,
            "tokens": self.tokens,
            "history": self.history,
            "gate": self.gate.summary() if self.gate is not None else None,
            "decision": self.decision,
            "sharded": self.sharded,
            "seconds": self.seconds,
            "resumed_from": self.resumed_from,
        }


def run_loss(history: list[dict[str, Any]], resumed_from: int | None = None) -> float | None:
    """The mean training loss over the steps of a phase's logged losses (`history`: the Trainer's log entries with a
    "loss"; None without any), each entry weighted by the steps it averages.

    Not the Trainer's `training_loss`, which averages only the steps this process ran (a resumed run's, not the
    stopped run's before them) and adds the steps after the last log as this process's own loss (rank 0's alone
    under DDP). Each logged loss is the mean over the processes of their losses since the previous log (the Trainer
    gathers them), and the log survives a resume in the checkpoint's trainer_state.json; `_LogAtBoundaries` logs at
    every checkpoint and at the end, so the entries cover every step and a resumed phase logs the windows an
    unstopped one does. An entry is the mean since the previous entry or, first after `resumed_from`, since that
    step (the Trainer starts counting again there); steps a stopped run trained after its last log are lost, and
    the mean is over the steps the log covers (every step, in a phase checkpointed with `_LogAtBoundaries`)."""
    total, covered, last = 0.0, 0, 0
    for entry in history:
        step = int(entry["step"])
        start = resumed_from if resumed_from is not None and last < resumed_from < step else last
        total += float(entry["loss"]) * (step - start)
        covered += step - start
        last = step
    return total / covered if covered else None


#: The speed metrics the Trainer adds to each log entry while it counts the tokens seen: the wall clock's, which no
#: two runs share, so the record's loss history leaves them out (`train_seconds` gives the time).
_TIMINGS = ("train_runtime", "train_tokens_per_second", "train_samples_per_second", "train_steps_per_second")


def _without_timings(entry: dict[str, Any]) -> dict[str, Any]:
    """A log entry of the Trainer without its wall-clock speed metrics: the same in every run of the same healing."""
    return {key: value for key, value in entry.items() if key not in _TIMINGS}


def _log_at_boundaries() -> Any:
    """A TrainerCallback (`_LogAtBoundaries`) that has the Trainer log the loss wherever a run can end or be resumed
    from: before every checkpoint and at the end of every epoch (the end of training included)."""
    from transformers import TrainerCallback

    class _LogAtBoundaries(TrainerCallback):
        """Asks for a log at each checkpoint (the Trainer logs before it saves, so the checkpoint's log history ends
        on it, and a run resumed there starts its first window where the stopped run ended one) and at each epoch's
        end (the steps after the last log would otherwise reach only `training_loss`, as one process's loss). The
        same on every process: the log gathers the loss over them, a collective every process must join."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if control.should_save:
                control.should_log = True
            return control

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            control.should_log = True
            return control

    return _LogAtBoundaries()


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
        record["resumed_from"], record["train_loss"], record.get("tokens"),
    )  # fmt: skip


def _train(trainer: Any, gate: Any, checkpoint: str | None) -> Any:
    """`trainer.train`, resumed from `checkpoint`; no step where the gate restored from it had already stopped the
    phase (a run killed between that stop and the phase's record): the run it continues trained no further step. The
    Trainer's state, its log included, is then the checkpoint's."""
    if checkpoint is None or gate is None or not gate.stopped:
        return trainer.train(resume_from_checkpoint=checkpoint)
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    return TrainOutput(trainer.state.global_step, math.nan, {})


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
    # The Trainer counts the attention mask's tokens of every batch on every process (gathered), and keeps the count
    # in its checkpoints: the real tokens trained on, padding not included, across a resume.
    if "include_num_input_tokens_seen" not in config.extra_training_args:  # a user's own choice stands
        arguments.include_num_input_tokens_seen = "non_padding"
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
            deferred=trainer.is_fsdp_enabled,  # the Trainer places a sharded model only when it shards it
        )
        trainer.add_callback(gate)
    clock = None
    if folder is not None:
        clock = CheckpointState(gate, config, saved["seconds"] if saved is not None else 0.0, is_writer(), identity)
        trainer.add_callback(clock)
    trainer.add_callback(_log_at_boundaries())  # last: after the callbacks that ask for a checkpoint
    result = _train(trainer, gate, checkpoint)
    history = [_without_timings(entry) for entry in trainer.state.log_history if "loss" in entry]
    decision = gate.restore_best_() if gate is not None else "no gate (heldout_rows=0)"
    seconds = clock.seconds() if clock is not None else result.metrics.get("train_runtime") or 0.0
    resumed_from = saved["step"] if saved is not None else None
    mean_loss = run_loss(history, resumed_from)
    # None where the Trainer counted nothing (a model whose main input is not input_ids): the record then gives the
    # positions, as it did before the tokens were counted.
    tokens = int(trainer.state.num_input_tokens_seen) or None
    phase = _Phase(
        result, history, gate, decision, bool(getattr(trainer, "is_fsdp_enabled", False)), seconds, resumed_from,
        result.training_loss if mean_loss is None else mean_loss, tokens,
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
