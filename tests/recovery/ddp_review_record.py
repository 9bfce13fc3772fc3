"""The loss a healing's record reports, under 2 processes: run as a script under torchrun for
tests/recovery/test_review_record.py, which compares what rank 0 saves with one process.

Every process heals `ddp_heal.heal("full", ...)` (the same tiny model, rows and global batch as test_ddp.py) with a
log every `LOGGING_STEPS` steps that does not divide its `ddp_heal.STEPS`: once uninterrupted, and once checkpointed
every 2 steps, stopped as step `ddp_heal.STOP_AT` ends and resumed. Rank 0 writes each log to ``OUT/<name>.pt``.

    python -m torch.distributed.run --nproc_per_node 2 tests/recovery/ddp_review_record.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # ddp_heal, which puts tests/ on the path for its own imports

import ddp_heal  # noqa: E402
import torch  # noqa: E402

#: Steps between the Trainer's loss logs: 3 of `ddp_heal.STEPS` (4), so the last step is after the last log.
LOGGING_STEPS = 3
#: Steps between checkpoints of the stopped run (it resumes from the checkpoint of step 2).
SAVE_EVERY = 2


def heal(processes: int, **options: Any) -> dict[str, Any]:
    """The log of `ddp_heal.heal("full", processes)` logged every `LOGGING_STEPS` steps, with `options`."""
    return ddp_heal.heal("full", processes, logging_steps=LOGGING_STEPS, **options)[2]


def heal_stopped_then_resumed(processes: int, folder: Path) -> dict[str, Any]:
    """The log of `heal(processes)` checkpointed every `SAVE_EVERY` steps, stopped as step `ddp_heal.STOP_AT` ends on
    every process, then resumed (the same call again)."""
    import torch.distributed as dist

    from optimum_flatten.recovery.resume import CheckpointState

    def stopping(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == ddp_heal.STOP_AT:
            raise ddp_heal.Stopped(f"stopped at step {ddp_heal.STOP_AT}")
        return control

    CheckpointState.on_step_end = stopping  # type: ignore[method-assign]
    try:
        heal(processes, checkpoint_dir=str(folder), save_every=SAVE_EVERY)
    except ddp_heal.Stopped:
        pass
    finally:
        del CheckpointState.on_step_end  # the callback's own (TrainerCallback's) again
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written every checkpoint before any process resumes
    return heal(processes, checkpoint_dir=str(folder), save_every=SAVE_EVERY)


def main(out: str) -> None:
    import torch.distributed as dist

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    main_process = int(os.environ.get("RANK", "0")) == 0
    logs = {
        "uninterrupted": heal(processes),
        "resumed": heal_stopped_then_resumed(processes, Path(out) / "checkpoints"),
    }
    if main_process:
        for name, log in logs.items():
            torch.save(log, Path(out) / f"{name}.pt")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
