"""Torch helpers shared by calibration, methods and evaluation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU for a parameterless module).

    With accelerate offload the parameters may sit on the meta device until the hook onloads them; the execution
    device recorded by the hook is then the one that matters.
    """
    hook = getattr(module, "_hf_hook", None)
    execution_device = getattr(hook, "execution_device", None)
    if execution_device is not None:
        return torch.device(execution_device)
    for parameter in module.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")


def input_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: the device of its input embeddings, or the execution device accelerate's hook
    gives them when every weight is offloaded (then no parameter has a real device)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in (embeddings, model):
        if isinstance(module, nn.Module):
            hook = getattr(module, "_hf_hook", None)
            if getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return module_device(embeddings if isinstance(embeddings, nn.Module) else model)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of a model's weights (meta parameters keep theirs, so offloading does not hide it)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def count_parameters(module: nn.Module) -> int:
    """Number of unique parameters (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for parameter in module.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        total += parameter.numel()
    return total


def first_output(output: object) -> torch.Tensor:
    """Decoder layers return a tensor in transformers 5 and a tuple in 4.x; the hidden state is always first."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        raise TypeError(f"cannot find a hidden state in a layer output of type {type(output).__name__}")
    return hidden


def synchronize(device: torch.device | str | None = None) -> None:
    """Waits until every kernel queued on `device` has finished; a no-op on the CPU.

    Accelerators run asynchronously: a host clock read right after a forward returns measures the kernel launches,
    not the work. Every timed region therefore synchronises before it starts (so earlier work is not billed to it)
    and before it stops (so its own work is). `device=None` synchronises the current CUDA device when CUDA is
    already in use (for timers that do not know the model's device, e.g. a phase timer) and never initialises CUDA.
    """
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(device)
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()


def resolve_device(name: str | torch.device | None) -> torch.device:
    """A device from a user's `--device`: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``,
    ``cuda:1``, ... Refused with a one-line reason when this torch cannot use it, before any model is loaded."""
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"unknown device {str(name)!r}: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(name)!r}: no CUDA device is available to this torch ({torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {str(name)!r}: MPS is not available")
    elif device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"device {str(name)!r}: no XPU is available")
    elif device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"device {str(name)!r}: use auto, cpu, cuda or cuda:N")
    return device


@contextlib.contextmanager
def keeping_use_cache(model: nn.Module) -> Iterator[None]:
    """Puts back ``model.config.use_cache`` after the block: transformers' Trainer sets it to its
    ``TrainingArguments.use_cache`` (False) when it is built, and a checkpoint saved after training would then say
    ``"use_cache": false``, so that a plain forward of the reloaded model returns no cache."""
    config = getattr(model, "config", None)
    before = getattr(config, "use_cache", None)
    try:
        yield
    finally:
        if config is not None and before is not None:
            config.use_cache = before
