"""Runs a block only as far as a statistic needs: up to the input of one of its modules, the rest skipped.

A method that measures what enters one projection (FlattenGPT's o_proj input for head scores, its down-projection
input for the MLP second moment) does not need the block's output: the work after that projection (and the
projection itself) is thrown away. `run_to_input` stops the forward there by raising from a forward pre-hook, so a
statistic costs only the part of the block in front of it. What is captured is exactly what a full run would hand
the hook.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..utils.torch_utils import module_device
from .capture import LayerwiseRunner, _to_device


class _Reached(Exception):
    """Raised by the pre-hook once the target module's input has been handed over."""


def weights_run(module: nn.Module, skipped: Iterable[nn.Module]) -> int:
    """Parameters of `module` outside the `skipped` submodules (tied tensors once): what a stopped forward uses."""
    skipped_ids = {id(p) for part in skipped for p in part.parameters()}
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values() if id(p) not in skipped_ids)


@torch.no_grad()
def run_to_input(
    runner: LayerwiseRunner,
    module: nn.Module,
    position: int,
    inputs: Sequence[torch.Tensor],
    target: nn.Module,
    callback: Callable[[int, torch.Tensor], None],
    skipped: Iterable[nn.Module],
) -> None:
    """Runs `module` as the layer at `position` on every batch until `target` is called; `callback(b, x)` gets the
    input `x` of `target` on batch `b` and the rest of the forward is not run.

    `skipped` are the submodules that do not run (the target and what follows it): the runner's work counter adds
    only the other weights, so the report's stack passes count what was computed.

    Raises:
        RuntimeError: the forward finished without calling `target`.
    """
    device = module_device(module)
    weights = weights_run(module, skipped)
    for b, hidden in enumerate(inputs):
        runner.work += weights * hidden.shape[0] * hidden.shape[1]
        kwargs = _to_device(runner.layer_kwargs[position][b], device)
        # One hook per batch, bound to its index: the callback never has to be told which batch is running.
        handle = target.register_forward_pre_hook(functools.partial(_hand_over, callback, b))
        try:
            module(hidden.to(device), **kwargs)
        except _Reached:
            continue
        finally:
            handle.remove()
        raise RuntimeError(f"the forward of {type(module).__name__} never called {type(target).__name__}")


def _hand_over(callback: Callable[[int, torch.Tensor], None], batch: int, _module: nn.Module, args: tuple) -> None:
    callback(batch, args[0].detach())
    raise _Reached
