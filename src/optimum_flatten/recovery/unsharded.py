"""A healed model that FSDP2 left sharded across the processes, made whole for the save.

Under FSDP2 the Trainer shards the model in place and `recover` returns it so (its parameters are DTensors, one
shard a process). `save_pretrained` writes such a model only with a ``distributed_config`` transformers set at load
time, which a checkpoint loaded by ``from_pretrained`` on each rank does not have: rank 0 alone would try to write
shards. So the doors that save (`optimum-flatten recover`, ``compress --heal-tokens``, `FlattenQuantizer`) gather
the whole weights on rank 0 first, a collective every process makes, and load them into a plain model of the same
architecture that rank 0 saves as it saves any other.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..utils.launch import is_writer
from .gate import dtensor_class


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is an FSDP2 shard (a DTensor)."""
    dtensor = dtensor_class()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def unsharded_for_save(model: nn.Module, plain: Callable[[], nn.Module]) -> nn.Module:
    """`model` itself where nothing is sharded; under FSDP2, on rank 0, `plain()` (a model of the same architecture
    and parameter names, not sharded: the checkpoint reloaded, or a copy taken before the healing) holding the
    whole trained weights, and `model` unchanged on the other ranks, which write nothing.

    Every process must call it: the weights are gathered with torch.distributed.checkpoint's
    ``get_model_state_dict`` (whole tensors, moved to the CPU on rank 0 alone, one parameter at a time, so no GPU
    holds more than one whole parameter beyond its shard).

    Raises:
        RuntimeError: `plain()` lacks a gathered weight or has one the healed model does not (``load_state_dict``'s
            strict check): it is not the healed model's architecture.
    """
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_writer():
        return model
    target = plain()
    target.load_state_dict(whole, strict=True)
    return target


def cpu_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the CPU, made without a second copy on its device (a
    GPU may not hold two): each tensor is copied to the CPU first and `copy.deepcopy` reuses it (tied weights stay
    one tensor). What `FlattenQuantizer` keeps on rank 0 before an FSDP2 healing, to hold the gathered weights."""
    import copy

    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            moved = tensor.detach().to("cpu", copy=True)
            memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    return copy.deepcopy(model, memo)
