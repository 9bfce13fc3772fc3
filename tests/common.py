"""Shared checkers and the one tolerance table of the test-suite."""

from __future__ import annotations

import torch

from tiny_models import VOCAB

#: Tolerances by dtype: (atol, rtol). float64 is used by the naive references, float32 by the tiny models.
TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol)


def sample_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def greedy_generate_both_ways(model, ids: torch.Tensor, new_tokens: int = 6):
    """Greedy generation with and without the KV cache."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without_cache = model.generate(ids, use_cache=False, **kwargs)
    return with_cache, without_cache


def shallower_reference(model, kept: list[int]):
    """A freshly built model of the same class holding only the `kept` layers (renumbered), copied from `model`.

    The independent reference for layer dropping: built from a config, not by editing the model under test.
    """
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [model.config.layer_types[i] for i in kept]
    reference = type(model)(config).to(torch.float32).eval()
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index not in kept:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{kept.index(index)}.", 1)
        state[name] = tensor
    reference.load_state_dict(state)
    return reference
