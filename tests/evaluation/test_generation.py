"""Generative agreement: greedy continuations of held-out prompts compared with the dense model's."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from optimum_flatten.evaluation.generation import (
    compare_continuations,
    generation_agreement,
    greedy_continuations,
    held_out_prompts,
)


def test_compare_continuations_against_a_naive_count():
    reference = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    candidate = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8], [2, 1, 1, 1]])
    tokens, prefix, exact = compare_continuations(reference, candidate)
    pairs = zip(reference.tolist(), candidate.tolist(), strict=True)
    agree = [[a == b for a, b in zip(r, c, strict=True)] for r, c in pairs]
    prefixes = [next((i for i, same in enumerate(row) if not same), len(row)) for row in agree]
    assert tokens == pytest.approx(sum(map(sum, agree)) / 12)
    assert prefix == pytest.approx(sum(prefixes) / 3) and prefix == pytest.approx((2 + 4 + 0) / 3)
    assert exact == pytest.approx(1 / 3)


def test_prompts_are_evenly_spaced_and_refused_when_the_text_is_short():
    stream = torch.arange(100)
    prompts = held_out_prompts(stream, prompts=4, prompt_length=5)
    assert prompts[:, 0].tolist() == [0, 25, 50, 75] and prompts.shape == (4, 5)
    with pytest.raises(ValueError, match="fewer than 4 prompts of 30"):
        held_out_prompts(stream, prompts=4, prompt_length=30)


def test_greedy_continuations_equal_a_step_by_step_argmax():
    """The continuation is the model's argmax fed back token by token (a cache-free naive loop)."""
    model = tiny_models.tiny_llama_gqa().eval()
    prompts = torch.randint(1, 90, (3, 6), generator=torch.Generator().manual_seed(0))
    generated = greedy_continuations(model, prompts, new_tokens=5, batch_size=2)
    ids = prompts.clone()
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, ids[:, 6:])


def test_a_model_agrees_with_itself_and_a_perturbed_one_less():
    dense = tiny_models.tiny_llama_gqa().eval()
    stream = torch.randint(1, 90, (400,), generator=torch.Generator().manual_seed(1))
    same = generation_agreement(dense, copy.deepcopy(dense), stream, prompts=4, prompt_length=8, new_tokens=8)
    assert (same.token_agreement, same.mean_agreeing_prefix, same.exact) == (1.0, 8.0, 1.0)
    other = copy.deepcopy(dense)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    drifted = generation_agreement(dense, other, stream, prompts=4, prompt_length=8, new_tokens=8)
    assert drifted.token_agreement < 1.0 and drifted.exact < 1.0
