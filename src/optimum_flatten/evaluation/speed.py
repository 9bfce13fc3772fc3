"""Inference speed measured as a median over repeats, for side-by-side ratios (never asserted in tests)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ..utils.torch_utils import input_device


def median_seconds(run: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall time of `run` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def prefill_tokens_per_second(
    model: nn.Module, seqlen: int = 256, batch_size: int = 1, repeats: int = 5, warmup: int = 1, seed: int = 0
) -> dict[str, float]:
    """Median prefill throughput (tokens/s) of a forward over random tokens of a fixed shape."""
    generator = torch.Generator().manual_seed(seed)
    device = input_device(model)
    ids = torch.randint(3, model.config.vocab_size, (batch_size, seqlen), generator=generator).to(device)
    model.eval()
    median = median_seconds(lambda: model(input_ids=ids, use_cache=False), repeats, warmup)
    return {
        "tokens_per_second": batch_size * seqlen / median,
        "median_seconds": median,
        "seqlen": seqlen,
        "batch_size": batch_size,
        "repeats": repeats,
    }


@torch.no_grad()
def decode_tokens_per_second(
    model: nn.Module,
    batch_size: int = 4,
    prompt_length: int = 64,
    new_tokens: int = 32,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Median greedy-decoding throughput (generated tokens/s over the whole batch), KV cache on, fixed length."""
    generator = torch.Generator().manual_seed(seed)
    device = input_device(model)
    ids = torch.randint(3, model.config.vocab_size, (batch_size, prompt_length), generator=generator).to(device)
    model.eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True)
    kwargs["pad_token_id"] = getattr(model.config, "pad_token_id", None) or 0
    median = median_seconds(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs), repeats, 1)
    return {
        "tokens_per_second": batch_size * new_tokens / median,
        "median_seconds": median,
        "batch_size": batch_size,
        "prompt_length": prompt_length,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }
