"""Torch helpers shared by calibration, methods and evaluation."""

from __future__ import annotations

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
