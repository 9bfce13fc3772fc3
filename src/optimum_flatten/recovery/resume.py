"""Healing that survives being stopped: checkpoints of the Trainer with the gate's state, and a resume that ends on
the weights a run never stopped would have given.

A long healing (a 70B model, or a million tokens on a CPU) runs in time-limited windows: a job is preempted, a
session ends. With `RecoveryConfig.checkpoint_dir` each Trainer phase of `recover` writes into its own folder
(``phase-1``, and ``phase-2`` for a global phase after `local`). Every `save_every` optimiser steps the Trainer
saves its checkpoint (weights, optimiser, schedule, random states, the data position), and `CheckpointState` adds
what the Trainer does not know about: the held-out gate (its scores, its best state so far, its patience count), the
training seconds of the attempts so far, and the healing options it was started with. That file is written last, so a
checkpoint without it (a process killed while saving) is never resumed from. A phase that finishes writes its log and
the trained state it ended on (the gate's best) as ``phase_done.json`` and ``phase_state.safetensors``; a resume
replays it instead of training it again.

Started again with the same `checkpoint_dir` and options (the line a killed job ran, run again), `recover` continues
from the newest complete checkpoint of the unfinished phase, as `FlattenConfig(resume_dir=...)` continues a
compression. The Trainer restores the optimiser, the schedule, the random states and the data order, and the gate
continues from its saved state, so the run ends where one uninterrupted run ends (tested to the bit on the CPU,
`tests/recovery/test_resume.py`, and on 2 processes against one, `tests/recovery/test_ddp.py`). A folder holding the
checkpoints of a healing with other options (anything but the checkpointing options themselves), or of another job
(another student, teacher or text: `healing_identity`), is refused before any weight changes, naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..options.recovery import RecoveryConfig
from ..utils.differences import describe_differences
from ..utils.files import write_atomically, write_bytes_atomically

#: Written into each Trainer checkpoint beside the Trainer's own files; its presence marks the checkpoint complete.
HEALING_STATE = "healing_state.json"
#: The gate's best trainable state so far, in the same checkpoint.
GATE_STATE = "gate_best_state.safetensors"
#: A finished phase's log, and the trainable state it ended on, in the phase's folder.
PHASE_DONE = "phase_done.json"
PHASE_STATE = "phase_state.safetensors"
#: The options that say where and how often to checkpoint (and where the teacher's sampled rows are kept), not what
#: is trained: they may differ on resume.
CHECKPOINT_OPTIONS = ("checkpoint_dir", "save_every", "teacher_text_cache")
#: Options added after healings were first checkpointed, with the value that held before each existed: a checkpoint
#: that does not name one was written at that value, and resumes under it.
ADDED_OPTIONS: dict[str, Any] = {"sampling_backend": "transformers"}

#: Training arguments that change what a run shows, not what it trains (``--no-progress`` sets ``disable_tqdm``): a
#: resume may add or drop them.
DISPLAY_ARGUMENTS = ("disable_tqdm", "report_to", "log_level", "log_level_replica")

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _without_display(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` less the `DISPLAY_ARGUMENTS` among their ``extra_training_args`` (a saved fingerprint's too, which
    may hold them: they were compared before)."""
    extra = options.get("extra_training_args")
    if not isinstance(extra, Mapping):
        return dict(options)
    return {**options, "extra_training_args": {k: v for k, v in extra.items() if k not in DISPLAY_ARGUMENTS}}


def check_checkpoint_options(config: RecoveryConfig) -> None:
    """Refuses checkpointing options that cannot work, before anything is built: a negative interval, and saving
    without a folder."""
    if config.save_every < 0:
        raise ValueError(f"save_every must be 0 (never) or a number of optimiser steps, got {config.save_every}.")
    if config.save_every and not config.checkpoint_dir:
        raise ValueError("save_every needs checkpoint_dir, the folder the healing's checkpoints are written to.")


#: The start of a phase's folder name under ``checkpoint_dir``; the phase's index follows.
PHASE_PREFIX = "phase-"


def phase_folder(config: RecoveryConfig, index: int) -> str:
    """The Trainer's output folder for phase `index` (1, or 2 for a global phase after `local`)."""
    return os.path.join(str(config.checkpoint_dir), f"{PHASE_PREFIX}{index}")


def phase_folders(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """The phases' folders a healing wrote under `checkpoint_dir`, in order: what a caller deletes once the result is
    kept, leaving the rest of the folder (the teacher's cached text) to a rerun."""
    return sorted(path for path in Path(checkpoint_dir).glob(f"{PHASE_PREFIX}*") if path.is_dir())


def options_fingerprint(config: RecoveryConfig, identity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options a resumed run must share with the run it continues: all but the checkpointing options, as JSON
    (values that JSON cannot hold, such as a callable in `extra_training_args`, by their text), and the job's
    `identity` (`healing_identity`) under ``job``."""
    options = _without_display({k: v for k, v in dataclasses.asdict(config).items() if k not in CHECKPOINT_OPTIONS})
    if identity is not None:
        options["job"] = dict(identity)
    return json.loads(json.dumps(options, sort_keys=True, default=str))


#: What each field of `healing_identity` names in a refusal.
_IDENTITY_NAMES = {
    "student": "the model being healed",
    "teacher": "the teacher",
    "rows": "the training rows",
    "heldout": "the held-out and guard rows",
    "processes": "the number of processes (so the global batch and the steps)",
    "dtype": "the dtype of the weights trained (recover --dtype)",
}


def healing_identity(
    student: str,
    teacher: str | None,
    train: list[Mapping[str, torch.Tensor]],
    heldout: list[Mapping[str, torch.Tensor]],
    processes: int = 1,
    dtype: str = "",
) -> dict[str, Any]:
    """What a resumed healing must share with the run it continues besides its options: the student's and the
    teacher's `utils.fingerprint.weights_fingerprint` (taken before training, and blind to the dtype), digests of
    the rows it trains and is gated on (the teacher's sampled rows included, which a resume reads from its cache),
    the number of processes (the global batch, hence the steps of the budget) and the trained weights' dtype. Without
    it a folder reused for another model or text would replay the first healing's finished state into this one, and
    a resume on other ranks or in another dtype would go on silently towards weights no single run reaches."""
    rows = {"rows": _rows_digest(train), "heldout": _rows_digest(heldout)}
    return {"student": student, "teacher": teacher, **rows, "processes": processes, "dtype": dtype}


def _rows_digest(rows: list[Mapping[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(str(len(rows)).encode())
    for row in rows:
        for key in sorted(row):
            digest.update(key.encode())
            digest.update(row[key].detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of every file below `folder` (0 when there is none): what a finished healing's checkpoints still hold
    on disk (up to two of each phase, weights and optimiser state), told to the user so they can free it."""
    root = Path(folder)
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) if root.is_dir() else 0


def latest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint of a phase's folder (one that holds `HEALING_STATE`), or None."""
    path = Path(folder)
    if not path.is_dir():
        return None
    steps = [
        (int(match.group(1)), child)
        for child in path.iterdir()
        if (match := _CHECKPOINT.match(child.name)) and (child / HEALING_STATE).exists()
    ]
    return str(max(steps)[1]) if steps else None


def read_checkpoint(
    checkpoint: str, config: RecoveryConfig, identity: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The healing state saved in `checkpoint`, its gate's best state among it (``best_state``); refuses a
    checkpoint written with other options or by another job (`identity`)."""
    state = json.loads((Path(checkpoint) / HEALING_STATE).read_text())
    _check_same_options(state["options"], config, checkpoint, identity)
    if state.get("gate") is not None:
        from safetensors.torch import load_file

        state["gate"]["best_state"] = load_file(str(Path(checkpoint) / GATE_STATE))
    return state


def started_options(config: RecoveryConfig) -> dict[str, Any] | None:
    """The options the healing in `config.checkpoint_dir` was started with (its first phase's record, or that
    phase's newest complete checkpoint), None when the folder holds no healing."""
    if not config.checkpoint_dir:
        return None
    folder = Path(phase_folder(config, 1))
    if (folder / PHASE_DONE).is_file():
        return json.loads((folder / PHASE_DONE).read_text())["options"]
    checkpoint = latest_checkpoint(str(folder))
    return json.loads((Path(checkpoint) / HEALING_STATE).read_text())["options"] if checkpoint else None


def same_options(saved: Mapping[str, Any], config: RecoveryConfig) -> bool:
    """Whether `config` is what the saved options (`options_fingerprint`, the job aside) were."""
    saved = _without_display({**ADDED_OPTIONS, **saved})
    saved.pop("job", None)
    return saved == options_fingerprint(config)


def check_started_options(config: RecoveryConfig) -> None:
    """Refuses a healing whose `checkpoint_dir` holds one started with other options, naming them, before any row is
    read or sampled: the teacher's rows are kept in that folder too, and sampling another job's over them would lose
    the rows the interrupted job needs (hours at 7B), only for the phase's own check to refuse it afterwards."""
    saved = started_options(config)
    if saved is not None:
        _check_same_options(saved, config, phase_folder(config, 1))


def _check_same_options(
    saved: Mapping[str, Any], config: RecoveryConfig, where: str, identity: Mapping[str, Any] | None = None
) -> None:
    """Refuses a resume from `where` whose options, then job (`healing_identity`, where given), are not this run's:
    the options first, since they name what the user changed (another seed also changes the rows)."""
    saved = _without_display({**ADDED_OPTIONS, **saved})
    job = saved.pop("job", None)  # absent: written before jobs were recorded, which can only be trusted
    detail = describe_differences(saved, options_fingerprint(config))
    if detail:
        raise ValueError(
            f"{where} was written by a healing with other options ({detail}); resume with the options it was started "
            "with, or start afresh in an empty checkpoint_dir."
        )
    if job is not None and identity is not None:  # a field the saved job lacks was not recorded then: not compared
        other = [
            name + (f": {job[k]} then, {identity.get(k)} now" if k in ("processes", "dtype") else "")
            for k, name in _IDENTITY_NAMES.items()
            if k in job and job[k] != identity.get(k)
        ]
        if other:
            raise ValueError(
                f"{where} holds the healing of another job ({'; '.join(other)} differ); start it in an empty "
                "checkpoint_dir, or resume with the model, teacher, text, processes and dtype it was started with."
            )


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    whole = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    write_atomically(path, lambda temporary: save_file(whole, str(temporary)))


def _save_json(value: Mapping[str, Any], path: Path) -> None:
    write_bytes_atomically(path, (json.dumps(value, indent=2) + "\n").encode())


class CheckpointState(TrainerCallback):
    """Adds the healing's own state to each checkpoint the Trainer saves (see the module docstring).

    Args:
        gate: The phase's `HeldOutGate`, or None without one.
        config: The healing options (their fingerprint is saved, and compared on resume).
        identity: The job's `healing_identity`, saved with them.
        seconds_before: Training seconds of the attempts before this one.
        main: Whether this process writes (rank 0 of a distributed launch; every process saves the same state).
    """

    def __init__(
        self,
        gate: Any,
        config: RecoveryConfig,
        seconds_before: float,
        main: bool,
        identity: Mapping[str, Any] | None = None,
    ) -> None:
        self.gate, self.seconds_before, self.main = gate, seconds_before, main
        self.options = options_fingerprint(config, identity)
        self._began = time.perf_counter()

    def seconds(self) -> float:
        """Training seconds so far, the attempts before this one included."""
        return self.seconds_before + time.perf_counter() - self._began

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._began = time.perf_counter()
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self.main:
            return control
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        gate = None
        if self.gate is not None:
            gate = self.gate.state_dict()
            _save_tensors(gate.pop("best_state"), folder / GATE_STATE)
        saved = {"step": state.global_step, "seconds": self.seconds(), "options": self.options, "gate": gate}
        _save_json(saved, folder / HEALING_STATE)  # last: it marks the checkpoint complete
        return control


def save_phase(
    folder: str,
    config: RecoveryConfig,
    record: Mapping[str, Any],
    trained: Mapping[str, torch.Tensor],
    identity: Mapping[str, Any] | None = None,
) -> None:
    """Writes a finished phase's log (`record`) and the trainable state it ended on into its folder."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    _save_tensors(trained, path / PHASE_STATE)
    _save_json({"options": options_fingerprint(config, identity), **record}, path / PHASE_DONE)


def read_phase(
    folder: str, config: RecoveryConfig, identity: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """A finished phase's log and trained state, or None when the phase has not finished; refuses a phase of
    other options or of another job (`identity`)."""
    path = Path(folder)
    if not (path / PHASE_DONE).exists():
        return None
    from safetensors.torch import load_file

    record = json.loads((path / PHASE_DONE).read_text())
    _check_same_options(record.pop("options"), config, folder, identity)
    return record, load_file(str(path / PHASE_STATE))
