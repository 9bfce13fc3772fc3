"""Inference speed measured as a median over repeats, for side-by-side ratios (never asserted in tests)."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


@torch.no_grad()
def prefill_tokens_per_second(
    model: nn.Module, seqlen: int = 256, batch_size: int = 1, repeats: int = 5, warmup: int = 1, seed: int = 0
) -> dict[str, float]:
    """Median prefill throughput (tokens/s) of a forward over random tokens of a fixed shape."""
    generator = torch.Generator().manual_seed(seed)
    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    ids = torch.randint(3, model.config.vocab_size, (batch_size, seqlen), generator=generator).to(device)
    model.eval()
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "tokens_per_second": batch_size * seqlen / median,
        "median_seconds": median,
        "seqlen": seqlen,
        "batch_size": batch_size,
        "repeats": repeats,
    }
