"""The gate that never makes a model worse: held-out scoring during training, the best state kept, early stopping.

Held-out rows of the training text (never trained on) are scored with the training objective before the first
step and every `eval_every` steps. The best trainable state seen so far is kept in memory (only the trainable
parameters, on the CPU, so the copy costs what they cost, not the model); after `patience` evaluations without
improvement training stops. At the end the best state is loaded back; if no evaluation beat the starting score the
best state *is* the input weights, and the log says ``"gate": "kept input weights"``.

A guard (`RecoveryConfig.guard_text`, or in a mix the user's own held-out rows) is a second set of held-out rows that
the healing must not make worse: scored at the same evaluations, and a state counts as an improvement only where the
guard's objective is no higher than the input's. The objective alone cannot see that: on Qwen2.5-Coder, healing on
the teacher's own text took the held-out teacher rows' KL from 0.61 to 0.23 while real prose got worse (benchmarks/
NOTEBOOK.md, "What an instruct model writes").

Under a data-parallel launch (``torchrun`` / ``accelerate launch``, DDP) every process runs `recover` and holds its
own gate. Each scores *all* the held-out rows (the same rows on every process: the split is seeded) with the same
weights (DDP keeps the replicas equal), so each finds the same score; rank 0's scores are still broadcast to the
others, so that the decisions (stop now, keep this state) cannot part ways on a round-off: a process that stopped
alone would leave the others waiting in the next gradient all-reduce for ever. Every process then restores the same
best state, and only rank 0 logs.

Under FSDP2 (``fsdp_config={"version": 2}``; the Trainer shards the model in place, its parameters become DTensors
holding one shard per process) the gate works on whole parameters, never on shards: scoring runs the sharded model's
own forward (it gathers each unit's parameters as it goes), the snapshot gathers every trainable parameter whole
(`full_tensor`, a collective that every process makes in the same order, since their decisions agree) and the
restore cuts the whole best state back into this process's shard (`load_full_`). The first scoring and snapshot wait
for the Trainer to shard the model (`on_train_begin`, with ``deferred``): under FSDP the Trainer leaves the model
where it was loaded, on the CPU, until then, while the teacher is already on the process's GPU, and NCCL moves CUDA
tensors only. After each scoring the units that the forward left gathered (accelerate keeps the
final norm and LM head gathered after a forward, since a backward normally follows at once) are resharded
(`reshard_`), so that the restore writes into the shards, not into a gathered copy that the next reshard would
throw away (which would leave the LM head and the final norm at their last trained values).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..utils.launch import collective_device, is_writer
from .distill import LossParts

logger = logging.getLogger(__name__)

KEPT_INPUT = "kept input weights"
IMPROVED = "kept the best trained state"


def dtensor_class() -> type | None:
    """torch's DTensor class (FSDP2's parameters), or None where torch has no distributed package."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of `tensor`: itself, or for an FSDP2 parameter (a DTensor holding this process's shard) the
    parameter gathered from every process; a collective then, which every process must make in the same order."""
    dtensor = dtensor_class()
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor


@torch.no_grad()
def load_full_(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """Copies the whole tensor `value` into `parameter`; into an FSDP2 parameter, the shard of it this process
    holds (every process holds the same `value`, so the shards are cut locally, without communication)."""
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(parameter, dtensor):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(
            value.to(parameter.device, parameter.dtype),
            parameter.device_mesh,
            parameter.placements,
            src_data_rank=None,  # each process has the whole value: no scatter from rank 0
        )
    parameter.copy_(value.to(parameter.device))


def reshard_(model: nn.Module) -> None:
    """Under FSDP2, puts every unit of `model` (the root that accelerate shards) back to its sharded parameters
    after a forward outside training (see the module docstring); nothing otherwise.

    `FSDPModule.reshard` is not enough: the loss calls the LM head on its own after the forward, and accelerate puts
    the head in one unit with the final norm, so the unit's forward never completes (its other module has not run
    again) and it stays gathered, refusing to reshard. `reset_iter_state` ends that forward; between optimiser steps,
    where the gate runs, it drops no gradient, since none is pending.
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reset_iter_state()


def agree(scores: dict[str, float]) -> dict[str, float]:
    """Rank 0's `scores` on every process of a distributed launch (unchanged outside one); see the module
    docstring for why the gate's decisions must not rest on each process's own round-off."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return scores
    if torch.distributed.get_world_size() < 2:
        return scores
    keys = sorted(scores)
    # NCCL moves CUDA tensors only, gloo CPU ones: not the model's device, which is the CPU until FSDP places it.
    values = torch.tensor([scores[k] for k in keys], dtype=torch.float64, device=collective_device())
    torch.distributed.broadcast(values, src=0)
    return dict(zip(keys, values.tolist(), strict=True))


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter of `model`, whole and copied to the CPU (gathered from the shards under FSDP2: a
    collective every process makes): what the gate snapshots and a finished healing phase records."""
    return {
        name: full_tensor(p.detach()).to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad
    }


def check_trainable_names(model: nn.Module, names: Iterable[str], what: str) -> None:
    """Refuses a saved state (`what`) that does not name exactly the parameters `model` trains: a checkpoint of
    another model or mode."""
    if set(names) != {name for name, p in model.named_parameters() if p.requires_grad}:
        raise ValueError(
            f"{what} holds other parameters than this model trains; resume with the model and mode the healing was "
            "started with."
        )


@torch.no_grad()
def load_trainable_state_(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Loads a `trainable_state` into `model`'s trainable parameters (into this process's shards under FSDP2),
    after `check_trainable_names`."""
    check_trainable_names(model, state, what)
    parameters = dict(model.named_parameters())
    for name, value in state.items():
        load_full_(parameters[name], value)


@torch.no_grad()
def score_rows(
    model: nn.Module,
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], LossParts],
    rows: Sequence[dict[str, torch.Tensor]],
    batch_size: int,
) -> dict[str, float]:
    """Token-weighted means of the objective, the LM loss and the KL over `rows`, in eval mode."""
    was_training = model.training
    model.eval()
    device = next(p.device for p in model.parameters())
    totals = {"objective": 0.0, "lm": 0.0, "kl": 0.0}
    count = 0
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            batch = {key: torch.stack([row[key] for row in chunk]).to(device) for key in chunk[0]}
            parts = loss(model, batch)
            totals["objective"] += float(parts.total) * parts.tokens
            totals["lm"] += parts.lm * parts.tokens
            totals["kl"] += parts.kl * parts.tokens
            count += parts.tokens
    finally:
        model.train(was_training)
    return {key: value / max(count, 1) for key, value in totals.items()}


class HeldOutGate(TrainerCallback):
    """Scores the held-out rows every `eval_every` steps, keeps the best trainable state where the guard's rows are
    no worse than at the start, stops after `patience` evaluations without one.

    Args:
        model: The model being trained (the same object the Trainer holds).
        loss: The training objective (a `DistillationLoss`).
        rows: Held-out rows, disjoint from the training rows.
        eval_every: Steps between evaluations.
        patience: Evaluations without improvement before stopping (0 never stops early).
        batch_size: Rows per held-out batch.
        state: A `state_dict` to continue from (a resumed healing, `recovery.resume`) instead of scoring the model
            as it is now: the starting scores, the best state and the patience count are the saved ones.
        guard: Held-out rows whose objective may not rise above its start for a state to be kept (None: no guard).
        deferred: Score the start when training begins (`on_train_begin`) instead of now: under FSDP, where the
            Trainer places the model only as it shards it.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Callable[[nn.Module, dict[str, torch.Tensor]], LossParts],
        rows: Sequence[dict[str, torch.Tensor]],
        eval_every: int,
        patience: int,
        batch_size: int,
        state: Mapping[str, Any] | None = None,
        guard: Sequence[dict[str, torch.Tensor]] | None = None,
        deferred: bool = False,
    ) -> None:
        if eval_every < 1:
            raise ValueError(f"eval_every must be at least 1 step, got {eval_every}.")
        if patience < 0:
            raise ValueError(f"patience must be at least 0, got {patience}.")
        if not rows:
            raise ValueError("the gate needs at least one held-out row; raise heldout_rows or give more text.")
        self.model, self.loss, self.rows = model, loss, list(rows)
        self.guard = list(guard) if guard else []
        self.eval_every, self.patience, self.batch_size = eval_every, patience, batch_size
        if state is not None:
            self.load_state_dict(state)
            return
        self.start: dict[str, float] | None = None
        if not deferred:
            self._begin()

    def _begin(self) -> None:
        """The starting scores and the input weights' snapshot: the state the gate keeps unless a step beats it."""
        self.start = self._score()
        self.best = dict(self.start)
        self.best_step = 0
        self.best_state = trainable_state(self.model)
        self.guard_start = self._score(self.guard) if self.guard else None
        self.guard_best = self.guard_start
        self.guard_refused: list[int] = []
        self.history: list[dict[str, float]] = [{"step": 0, **self.start, **self._guard_entry(self.guard_start)}]
        self.misses = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything the gate has learnt so far (scores, best step and state, patience count), for a checkpoint."""
        return {
            "start": dict(self.start),
            "best": dict(self.best),
            "best_step": self.best_step,
            "best_state": dict(self.best_state),
            "history": [dict(entry) for entry in self.history],
            "misses": self.misses,
            "guard_start": self.guard_start,
            "guard_best": self.guard_best,
            "guard_refused": list(self.guard_refused),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a `state_dict`; refuses one whose best state does not name this model's trainable
        parameters (a checkpoint of another model or mode)."""
        check_trainable_names(self.model, state["best_state"], "the saved gate's best state")
        self.start, self.best = dict(state["start"]), dict(state["best"])
        self.best_step, self.misses = int(state["best_step"]), int(state["misses"])
        self.best_state = {name: tensor.to("cpu", copy=True) for name, tensor in state["best_state"].items()}
        self.history = [dict(entry) for entry in state["history"]]
        self.guard_start, self.guard_best = state.get("guard_start"), state.get("guard_best")
        self.guard_refused = list(state.get("guard_refused", []))
        if self.guard and self.guard_start is None:
            raise ValueError(
                "the saved gate has no guard scores, and this healing has a guard: resume with the options it was "
                "started with, or start afresh in an empty checkpoint_dir."
            )

    def _score(self, rows: Sequence[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        scores = score_rows(self.model, self.loss, self.rows if rows is None else rows, self.batch_size)
        reshard_(self.model)
        return agree(scores)

    @staticmethod
    def _guard_entry(scores: Mapping[str, float] | None) -> dict[str, float]:
        """The guard's scores for the history. Its LM loss is kept beside the objective because the two can part:
        on Qwen2.5-Coder the KL of real text fell while its perplexity rose (NOTEBOOK.md, "A guard")."""
        if scores is None:
            return {}
        return {"guard_objective": scores["objective"], "guard_lm": scores["lm"], "guard_kl": scores["kl"]}

    def evaluate(self, step: int) -> bool:
        """Scores the held-out rows (and the guard's) at `step`; returns True when training should stop."""
        scores = self._score()
        guarded = self._score(self.guard) if self.guard else None
        self.history.append({"step": step, **scores, **self._guard_entry(guarded)})
        if is_writer():
            logger.info(
                "held-out at step %d: objective %.4f (best %.4f)", step, scores["objective"], self.best["objective"]
            )
        if math.isfinite(scores["objective"]) and scores["objective"] < self.best["objective"]:
            if guarded is None or guarded["objective"] <= self.guard_start["objective"]:
                self.best, self.best_step, self.best_state, self.misses = scores, step, trainable_state(self.model), 0
                self.guard_best = guarded
                return False
            self.guard_refused.append(step)  # better held-out rows, a worse guard: not kept, counted as a miss
            if is_writer():
                logger.info(
                    "held-out at step %d: not kept, the guard's objective rose %.4f -> %.4f",
                    step, self.guard_start["objective"], guarded["objective"],
                )  # fmt: skip
        self.misses += 1
        return self.stopped

    @property
    def stopped(self) -> bool:
        """Whether the gate has run out of patience (restored so from a checkpoint: the run had stopped there)."""
        return self.patience > 0 and self.misses >= self.patience

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.start is None:  # deferred: the Trainer has now sharded the model and placed it on its device
            self._begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step % self.eval_every == 0 or state.global_step >= state.max_steps:
            if self.evaluate(state.global_step):
                control.should_training_stop = True
        return control

    @torch.no_grad()
    def restore_best_(self) -> str:
        """Loads the best state into the model; returns the decision (`KEPT_INPUT` or `IMPROVED`)."""
        load_trainable_state_(self.model, self.best_state, "the gate's best state")
        return KEPT_INPUT if self.best_step == 0 else IMPROVED

    def summary(self) -> dict[str, Any]:
        """The gate's part of the recovery log."""
        return {
            "heldout_rows": len(self.rows),
            "heldout_before": self.start,
            "heldout_after": self.best,
            "best_step": self.best_step,
            "heldout_history": self.history,
            **(self._guard_summary() if self.guard_start is not None else {}),
        }

    def _guard_summary(self) -> dict[str, Any]:
        """The guard's rows, its objective at the start and at the kept state, and the evaluations it refused."""
        return {
            "guard": {
                "rows": len(self.guard),
                "before": self.guard_start,
                "after": self.guard_best,
                "refused_steps": list(self.guard_refused),
            }
        }
