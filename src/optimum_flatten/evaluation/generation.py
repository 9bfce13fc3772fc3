"""Generative agreement: how often greedy continuations of held-out prompts are the dense model's.

Perplexity, KL and top-1 agreement score each position on the reference text (teacher forcing); generation feeds a
model its own tokens, so a small per-token drift compounds. Depth compression loses generation first (Minitron's
depth-pruned models keep a third of GSM8K long after their perplexity has recovered), so this check sits beside the
per-token ones.

Protocol: `prompts` prompts of `prompt_length` tokens are cut from the evaluation stream at evenly spaced offsets
(no overlap, the same for both models); each model continues every prompt greedily (``do_sample=False``, no
repetition penalty, KV cache) for `new_tokens` tokens. Reported: the share of continuation tokens equal to the
dense model's at the same position (`token_agreement`), the mean length of the prefix that agrees
(`mean_agreeing_prefix`, in tokens: after the first difference the two continue from different contexts, so later
agreement means less), and the share of continuations identical in full (`exact`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..utils.torch_utils import input_device


@dataclass
class GenerationAgreement:
    """Agreement of a model's greedy continuations with the dense model's, and the protocol behind it."""

    token_agreement: float
    mean_agreeing_prefix: float
    exact: float
    prompts: int
    prompt_length: int
    new_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def protocol(self) -> str:
        return (
            f"{self.prompts} prompts of {self.prompt_length} tokens from the evaluation stream, greedy continuations "
            f"of {self.new_tokens} tokens with a KV cache, compared with the dense model's position by position"
        )


def held_out_prompts(stream: torch.Tensor, prompts: int = 16, prompt_length: int = 64) -> torch.Tensor:
    """(prompts × prompt_length) token ids cut from `stream` at evenly spaced, non-overlapping offsets.

    Raises:
        ValueError: when the stream is shorter than the prompts need.
    """
    if prompts < 1 or prompt_length < 1:
        raise ValueError(f"need at least one prompt of one token, got {prompts} × {prompt_length}.")
    stream = stream.reshape(-1)
    if stream.numel() < prompts * prompt_length:
        raise ValueError(
            f"the evaluation text has {stream.numel()} tokens, fewer than {prompts} prompts of {prompt_length} need."
        )
    step = stream.numel() // prompts
    return torch.stack([stream[i * step : i * step + prompt_length] for i in range(prompts)])


@torch.no_grad()
def greedy_continuations(model: nn.Module, prompts: torch.Tensor, new_tokens: int, batch_size: int = 8) -> torch.Tensor:
    """(prompts × new_tokens) greedy continuation ids; every row generates exactly `new_tokens` (no early stop)."""
    device = input_device(model)
    out = []
    for start in range(0, prompts.shape[0], batch_size):
        ids = prompts[start : start + batch_size].to(device)
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            pad_token_id=0,
            eos_token_id=None,
        )
        out.append(generated[:, ids.shape[1] :].cpu())
    return torch.cat(out)


def compare_continuations(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float, float]:
    """(token agreement, mean agreeing prefix length, share identical) of two (rows × tokens) id tensors."""
    same = reference == candidate
    prefix = torch.cumprod(same.to(torch.int64), dim=1).sum(dim=1).double()
    return float(same.double().mean()), float(prefix.mean()), float(same.all(dim=1).double().mean())


def generation_agreement(
    dense: nn.Module,
    model: nn.Module,
    stream: torch.Tensor,
    prompts: int = 16,
    prompt_length: int = 64,
    new_tokens: int = 32,
    reference: torch.Tensor | None = None,
) -> GenerationAgreement:
    """How often `model`'s greedy continuations of held-out prompts are `dense`'s (see the module docstring).

    `reference` takes the dense model's continuations when they were generated already (several models compared
    with one dense run); then `dense` may be None.
    """
    cut = held_out_prompts(stream, prompts, prompt_length)
    if reference is None:
        reference = greedy_continuations(dense, cut, new_tokens)
    candidate = greedy_continuations(model, cut, new_tokens)
    tokens, prefix, exact = compare_continuations(reference, candidate)
    return GenerationAgreement(tokens, prefix, exact, prompts, prompt_length, new_tokens)
