"""The healing runs of `ddp_heal.py` under FSDP2 on the CPU: run as a script under torchrun for
tests/recovery/test_fsdp.py.

transformers builds accelerate's FSDP plugin from ``fsdp=True, fsdp_config={"version": 2, ...}`` on any device, but
accelerate (1.15, `AcceleratorState.__init__`) turns a launch into an FSDP one only for accelerator process groups
(CUDA, XPU, NPU...); on a CPU it keeps the processes ``MULTI_CPU`` and the Trainer wraps the model in DDP, silently.
`shard_on_cpu` makes, for a CPU launch given a plugin, the one assignment accelerate makes on an accelerator
(distributed type FSDP, the plugin kept), so that everything after it is the code a GPU launch runs: the Trainer's
FSDP2 branches, accelerate's `fsdp2_prepare_model` and torch's `fully_shard` on a CPU device mesh, gloo moving the
shards. Rank 0 writes ``OUT/<run>.pt`` for each of `RUNS` as `ddp_heal.py` does; its log counts the healed model's
sharded (DTensor) parameters, so that a run that was DDP after all cannot pass for FSDP. One more run, `CPU_AS_IS`,
is made first without `shard_on_cpu`: what a user's ``fsdp=True`` gets on a CPU today (DDP, which `recover`'s log
must say).

    python -m torch.distributed.run --nproc_per_node 2 tests/recovery/fsdp_heal.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import torch  # noqa: E402

from recovery import ddp_heal  # noqa: E402

#: name -> the arguments of `ddp_heal.heal` besides the processes. `full` and `last_k` read per-process batches,
#: `changed` split ones (as in `ddp_heal.MODES`); at these rates every evaluation improves, so the gate keeps the
#: last step. `restored` overshoots (rate 0.1): the held-out objective is best at step 2 of 4, and the
#: gate must cut that gathered snapshot back into the shards. `kept_input` diverges (rate 0.3, patience 2): it stops
#: after step 2 and restores the snapshot taken before the Trainer sharded the model. `guarded` heals with
#: `ddp_heal.GUARD` as the gate's guard: the guard's rows are scored on the sharded model, which refuses steps 3
#: and 4, so the gate restores step 2 into the shards.
RUNS: dict[str, dict[str, Any]] = {
    "full": {"mode": "full", "split": False},
    "changed": {"mode": "changed", "split": True},
    "last_k": {"mode": "last_k", "split": False},
    "restored": {"mode": "full", "split": False, "learning_rate": 0.1},
    "kept_input": {"mode": "full", "split": False, "learning_rate": 0.3, "patience": 2},
    "guarded": {"mode": "full", "split": False, "guard_text": ddp_heal.GUARD},
}


#: The run of `RUNS["full"]` made without `shard_on_cpu`: what ``fsdp=True`` gives on a CPU as the libraries stand.
CPU_AS_IS = "cpu_as_is"


def shard_on_cpu() -> None:
    """Lets accelerate take its FSDP path on the CPU (see the module docstring)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "shards_on_cpu", False):
        return

    def init(self: AcceleratorState, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    init.shards_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init


def record_first_scores(seen: list[bool]) -> None:
    """Appends to `seen`, at each gate's first scoring, whether the model was sharded then: on a GPU the unsharded
    model is still on the CPU (the Trainer places it only as it shards it) while the teacher is on the GPU."""
    from torch.distributed.tensor import DTensor

    from optimum_flatten.recovery.gate import HeldOutGate

    begin = HeldOutGate._begin

    def recorded(self: HeldOutGate) -> None:
        seen.append(any(isinstance(p, DTensor) for p in self.model.parameters()))
        begin(self)

    HeldOutGate._begin = recorded


def main(out: str) -> None:
    import torch.distributed as dist

    seen: list[bool] = []
    record_first_scores(seen)
    # First as transformers and accelerate run it on a CPU (DDP, said in the log), then sharded.
    for name, run in [(CPU_AS_IS, RUNS["full"]), *RUNS.items()]:
        if name != CPU_AS_IS:
            shard_on_cpu()
        seen.clear()
        before, after, log = ddp_heal.heal(processes=int(os.environ["WORLD_SIZE"]), fsdp=True, **run)
        if dist.get_rank() == 0:
            record = {"before": before, "after": after, "log": log, "first_score_sharded": list(seen)}
            torch.save(record, Path(out) / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
