"""Calibration across processes: under torchrun or accelerate launch, each rank calibrates on its own share.

When a compression starts with a torch.distributed process group of more than one rank already up, the quantizer
gives every rank a disjoint, contiguous share of the calibration batches (`shard_range`) and runs the method under
`sharded_calibration`. A statistic is then summed over the ranks at the one point where it is complete and before
it is used (`all_reduce_`, `all_reduce_sums`): a float64 moment in its `finish`, a least-squares bridge's normal
equations before the solve, the sums and counts of a mean cosine or angle. Every rank then holds the same numbers,
makes the same decisions and writes the same weights; those equal a single process's on all the batches up to the
order of the float sums. Rank 0 alone writes a checkpoint (`utils.launch.is_writer`).

Outside `sharded_calibration` (one process, or a compression that was not sharded) the helpers do nothing, so code
that also runs on one rank alone (an evaluation on rank 0) never waits on a collective. Which methods are covered is
each method's `CompressionMethod.shards_calibration`; the others are refused before any work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from ..utils.launch import collective_device, process_group

_SHARDED: ContextVar[bool] = ContextVar("optimum_flatten_sharded_calibration", default=False)


def shard_range(num_batches: int, rank: int, world_size: int) -> range:
    """The batches of `rank`: a contiguous share, the shares as even as they can be, in rank order.

    Contiguous, so that rank 0 holds the first batches (a statistic that starts from its first batch, such as
    `CentredSecondMoment`'s centre, starts from the one a single process would), and concatenating the shares in rank
    order gives the batches in their order.
    """
    return range(rank * num_batches // world_size, (rank + 1) * num_batches // world_size)


def is_sharded() -> bool:
    """Whether the running compression calibrates on this rank's share only (statistics must be all-reduced)."""
    return _SHARDED.get()


@contextlib.contextmanager
def sharded_calibration(world_size: int) -> Iterator[None]:
    """Within the block, with `world_size` > 1, the statistics of the running compression are summed over ranks."""
    token = _SHARDED.set(world_size > 1)
    try:
        yield
    finally:
        _SHARDED.reset(token)


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sums `tensor` over the ranks in place (and returns it); nothing outside `sharded_calibration`.

    The collective runs where the backend wants it (NCCL: the current CUDA device; gloo: the CPU), and the result is
    copied back where the statistic lives.
    """
    if not is_sharded():
        return tensor
    import torch.distributed as dist

    device = collective_device()
    if tensor.device == device and tensor.is_contiguous():
        dist.all_reduce(tensor)
        return tensor
    moved = tensor.to(device).contiguous()
    dist.all_reduce(moved)
    tensor.copy_(moved)
    return tensor


def all_reduce_sums(*values: float) -> tuple[float, ...]:
    """Scalar sums (float64 running sums, token counts) over the ranks, in one collective; as given outside
    `sharded_calibration`. Counts stay exact below 2⁵³."""
    if not is_sharded():
        return tuple(values)
    packed = all_reduce_(torch.tensor(values, dtype=torch.float64))
    return tuple(float(v) for v in packed)


def global_batches(num_local: int) -> tuple[range, int]:
    """(the global indices of this rank's `num_local` batches, the number of batches over all ranks); within one
    process, ``(range(num_local), num_local)``. A collective under `sharded_calibration`: every rank calls it."""
    if not is_sharded():
        return range(num_local), num_local
    rank, world = process_group()
    counts = torch.zeros(world, dtype=torch.float64)
    counts[rank] = num_local
    all_reduce_(counts)
    start = int(counts[:rank].sum())
    return range(start, start + num_local), int(counts.sum())


def barrier() -> None:
    """Waits for every rank when a process group is up (so that no rank reads what rank 0 is still writing)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
