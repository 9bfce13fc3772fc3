"""Joining the process group a launcher describes: ``torchrun`` and ``accelerate launch`` start one process per
rank and say so in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
but nothing joins the ranks until someone calls ``torch.distributed.init_process_group``.

A Python caller usually does that itself; the command line and `recover` do it here, so that
``torchrun --nproc-per-node 2 -m optimum_flatten compress ...`` shards its calibration as the API does (every rank
on its share, rank 0 alone writing) instead of running two independent compressions that race on one folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


def launched_world_size() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 outside a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched_rank() -> int:
    """This process's rank as the launcher numbered it (``RANK``; 0 outside a launcher): known before the process
    group is joined, where `process_group` still says (0, 1) on every rank."""
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0


def processes_on_this_host() -> int:
    """How many of the launch's processes share this machine (``LOCAL_WORLD_SIZE``, which torchrun and accelerate
    launch set; 1 outside a launcher): on the CPU they share one memory, which each would otherwise count as its own."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def join_launcher_group() -> bool:
    """Joins the launcher's process group when there is one to join; returns whether this call created it.

    NCCL with each rank on its ``LOCAL_RANK`` GPU where CUDA is available, gloo on the CPU otherwise. Does nothing
    outside a launcher (``WORLD_SIZE`` 1 or unset), where torch.distributed is missing, or when the group is up
    already (a caller, or accelerate, joined it first).
    """
    if launched_world_size() <= 1:
        return False  # before importing torch: a command that refuses its arguments never loads it
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend)
    logger.info(
        "joined the launcher's process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend
    )
    return True


@contextlib.contextmanager
def launcher_process_group() -> Iterator[None]:
    """Within the block, the launcher's process group is up (see `join_launcher_group`); a group this block
    created is left at its end by each rank on its own, with no barrier. What runs after the last collective is
    rank 0's alone (the save, an upload to the Hub), and may outlast the group's timeout (10 minutes under NCCL, 30
    under gloo): ranks waiting for it at a barrier would time out, fail, and have the launcher stop rank 0 mid-write.
    The launcher waits for every rank to end, so leaving first loses nothing."""
    created = join_launcher_group()
    try:
        yield
    finally:
        if created:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def process_group() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """Whether this process writes files and logs what every rank would: rank 0 of a process group, or a process
    without one (the one answer the compression, the healing and the command line all ask)."""
    return process_group()[0] == 0


def collective_device() -> Any:
    """Where a collective runs: the current CUDA device under NCCL, the CPU under gloo (its tensors must be there)."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_ranks(value: int, op: str) -> int:
    import torch
    import torch.distributed as dist

    if process_group()[1] == 1:
        return value
    packed = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(packed, op=getattr(dist.ReduceOp, op))
    return int(packed.item())


def all_ranks_min(value: int) -> int:
    """The smallest of `value` over the ranks of an initialised process group (`value` itself without one)."""
    return _all_ranks(value, "MIN")


def all_ranks_sum(value: int) -> int:
    """`value` summed over the ranks (`value` itself without a group): a count each rank holds of its own share."""
    return _all_ranks(value, "SUM")


def all_ranks_max(value: int) -> int:
    """The largest of `value` over the ranks (`value` itself without a group): how the ranks agree on a choice
    each makes from its own device, such as how lean a training mode must be to fit its memory."""
    return _all_ranks(value, "MAX")
