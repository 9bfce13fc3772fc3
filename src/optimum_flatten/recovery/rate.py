"""The scale of a model's weights, which a default learning rate follows (`RecoveryConfig.rate_for`).

Adam moves each entry by about the learning rate whatever the entry's size, so the same rate is a step of a different
share of the weights on each model: SmolLM2-135M's weight matrices have a median root-mean-square entry of 0.19,
Qwen2.5-0.5B's 0.016, and the rate that heals the first wrecks the second in one step. The median over the weight
matrices is one number per model that no single odd tensor (an embedding, a tiny projection) moves.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

#: Entries per float64 piece of a tensor, so that no float64 copy of a whole embedding is ever made.
_PIECE = 1 << 22


def weight_scale(model: nn.Module) -> float:
    """Median over the model's weight matrices (parameters of two or more dimensions, each counted once) of the
    root-mean-square entry, summed in float64 on the parameter's own device.

    Raises:
        ValueError: the model has no weight matrix with values (none, or all on the meta device).
    """
    squares = []
    for parameter in model.parameters():
        if parameter.dim() < 2 or parameter.numel() == 0 or parameter.is_meta:
            continue
        flat = parameter.detach().reshape(-1)
        total = sum(torch.linalg.vector_norm(piece, dtype=torch.float64) ** 2 for piece in flat.split(_PIECE))
        squares.append((total / flat.numel()).to("cpu", non_blocking=False))
    if not squares:
        raise ValueError("the model has no weight matrix with values to take a weight scale from.")
    return statistics.median(torch.stack(squares).sqrt().tolist())
