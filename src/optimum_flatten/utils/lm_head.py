"""A causal LM's final states and its LM head, instead of its full logits.

A full-vocabulary logit tensor is (batch × seq × vocab): 4 × 512 × 151,936 float32 is 1.2 GB for Qwen2.5, and a
comparison of two models (fidelity, distillation) needs two of them and their log-softmaxes. So the logits are not
built: a forward pre-hook on the output embedding records its input, the final hidden states (batch × seq ×
hidden), and lets the head run on the last position only; the caller then pushes chunks of positions through the
head. A model whose logits are not simply head(hidden) (a logit soft-cap or scale after the head: Gemma-2/3, Cohere,
Granite) is recognised by comparing its own last-position logits with the head applied to the recorded state, and
falls back to its full logits with the identity as head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Head = Callable[[torch.Tensor], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def states_and_head(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, full: set[int]) -> tuple[Any, Head]:
    """(per-position states, map from a chunk of them to logits) of one forward of `model` on `ids`.

    Normally the states are the LM head's input and the map is the head. If the model has no output embedding
    module, or its last-position logits differ from head(hidden), the model is marked in `full` (so later batches
    skip the check) and its full logits are returned with the identity map. With autograd on, the states carry the
    graph; the check itself runs without it. A data-parallel wrapper (DDP, as the Trainer hands `compute_loss` under
    torchrun) is looked through for the head, and the forward still runs through it, so that its gradients sync.
    """
    owner = _unwrapped(model)
    head = owner.get_output_embeddings() if hasattr(owner, "get_output_embeddings") else None
    if isinstance(head, nn.Module) and id(model) not in full:
        captured: dict[str, torch.Tensor] = {}

        def keep_last_position(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
                return None
            captured["hidden"] = args[0]
            return (args[0][:, -1:], *args[1:])

        handle = head.register_forward_pre_hook(keep_last_position)
        try:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        finally:
            handle.remove()
        hidden = captured.get("hidden")
        if hidden is not None and tuple(hidden.shape[:2]) == tuple(ids.shape) and logits.shape[1] == 1:
            with torch.no_grad():
                direct = head(hidden[:, -1:])
                same = direct.shape == logits.shape and torch.allclose(
                    direct.float(), logits.float(), rtol=1e-5, atol=1e-6, equal_nan=True
                )
            if same:
                return hidden, head
        full.add(id(model))
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits, identity


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's or DataParallel's wrapper (which has no `get_output_embeddings`: without this, every
    data-parallel step built the student's full logits), else `model`."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, wrappers) else model
