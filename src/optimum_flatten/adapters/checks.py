"""The tiny forwards `validate` ends with: a cached decode against an uncached one, or an encoder's shapes.

Shared by every adapter (a wrong ``layer_idx`` shows only when a cache is read; a wrong size attribute only when the
module runs), so no family imports them from another.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..utils.cache import cache_keyword, returned_cache
from ..utils.torch_utils import first_output, input_device, model_dtype

#: Relative tolerance of the cached-vs-uncached check by parameter dtype (half precision rounds differently along
#: the two paths; a broken cache index is off by far more).
CACHE_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def check_cached_forward(model: nn.Module, atol: float | None = None) -> None:
    """One tiny forward with the KV cache (prefill + 2 decode steps) must match the uncached forward."""
    device = input_device(model)
    atol = CACHE_CHECK_TOLERANCE.get(model_dtype(model), 1e-3) if atol is None else atol
    config = model.config
    # A composite model (Gemma 3 with its vision tower) keeps the vocabulary in its text config.
    vocab = getattr(config, "vocab_size", None) or config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 6), generator=generator).to(device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        full = first_output(model(ids, use_cache=False).logits)
        out = model(ids[:, :4], use_cache=True)
        steps = [out.logits[:, -1]]
        cache = returned_cache(out)
        keyword = cache_keyword(model)
        for t in (4, 5):
            out = model(ids[:, t : t + 1], use_cache=True, **{keyword: cache})
            cache = returned_cache(out)
            steps.append(out.logits[:, -1])
    model.train(was_training)
    compare_cached_steps(steps, full, atol, "cached and uncached forwards disagree", "the KV cache indexing is broken.")


def compare_cached_steps(steps: list[torch.Tensor], full: torch.Tensor, atol: float, what: str, cause: str) -> None:
    """Raises ValueError when the outputs of the cached steps (prefill of 4, then one token at a time) differ from
    the uncached forward's at the same positions by more than `atol` times the largest output."""
    cached = torch.stack(steps, dim=1).float()
    reference = full[:, 3:].float()
    scale = reference.abs().max().clamp_min(1.0)
    if not torch.allclose(cached, reference, atol=atol * float(scale), rtol=0):
        diff = (cached - reference).abs().max().item()
        raise ValueError(f"{what} (max |diff| {diff:.3g}): {cause}")


@torch.no_grad()
def check_encoder_forward(base: nn.Module, inputs: dict[str, Any], expected_shape: tuple[int, ...], what: str) -> None:
    """One tiny forward of an encoder (no cache to compare) runs and gives finite states of `expected_shape`."""
    was_training = base.training
    base.eval()
    hidden = base(**inputs).last_hidden_state
    base.train(was_training)
    if tuple(hidden.shape) != expected_shape or not torch.isfinite(hidden).all():
        raise ValueError(f"the compressed {what}'s forward gave states of shape {tuple(hidden.shape)} or NaN/inf.")
