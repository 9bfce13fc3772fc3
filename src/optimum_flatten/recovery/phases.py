"""The phases of a healing: one Trainer run each (`_train_phase`), with the healing loss as the Trainer's loss, the
held-out gate as its callback, and a record that a resumed healing replays (`recovery.resume`) instead of training
a finished phase again. `recover` runs one phase, or two for `local` followed by the global loss."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..options.recovery import RecoveryConfig
from .distill import LossParts
from .resume import CheckpointState, latest_checkpoint, phase_folder, read_checkpoint, read_phase, save_phase

logger = logging.getLogger(__name__)


#: A healing objective: one batch's `LossParts` for a model (`DistillationLoss`, `local.LocalSpanLoss`).
Objective = Callable[[nn.Module, dict[str, torch.Tensor]], LossParts]


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
