"""The command line under FSDP2 on the CPU: run under torchrun for tests/cli/test_fsdp_doors.py.

Two changes make a CPU launch take the path a GPU launch takes when `full` does not fit one rank: accelerate is let
shard on the CPU (`recovery.fsdp_heal.shard_on_cpu`, the one assignment it makes on an accelerator), and the memory
check of the default mode reads one free byte, so that the default shards `full` with FSDP2 (`sharded_full`), as on
GPUs too small for it. Everything else is the command a user runs.

    python -m torch.distributed.run --nproc_per_node 2 tests/cli/fsdp_cli.py recover ...
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import optimum_flatten.recovery.footprint as footprint  # noqa: E402
from optimum_flatten.cli.main import main  # noqa: E402
from recovery.fsdp_heal import shard_on_cpu  # noqa: E402

if __name__ == "__main__":
    shard_on_cpu()
    footprint.available_bytes = lambda device: 1  # `full` fits no rank: the default shards it (FSDP2)
    sys.exit(main(sys.argv[1:]))
