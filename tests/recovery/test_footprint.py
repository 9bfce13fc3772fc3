"""The memory `mode='full'` is said to add (what the default mode follows), counted by hand on a tiny model."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from optimum_flatten.recovery import RecoveryConfig
from optimum_flatten.recovery.footprint import (
    HEADROOM,
    STATE_FACTOR,
    embedding_bytes,
    full_fits,
    full_footprint,
    teacher_bytes_to_load,
    weight_bytes,
)
from optimum_flatten.utils.memory import available_bytes


def test_the_footprint_counts_the_state_activations_and_teacher_by_hand():
    model = tiny_models.tiny_llama_gqa()
    text = model.config
    unique = {id(p): p for p in model.parameters()}.values()
    weights = 4 * sum(p.numel() for p in unique)  # float32, tied tensors once
    assert weight_bytes(model) == weights
    config = RecoveryConfig(per_device_train_batch_size=3, seqlen=32)
    footprint = full_footprint(model, config, teacher_bytes=1234)
    per_token_layer = 16 * text.hidden_size + 4 * text.intermediate_size + 2 * text.num_attention_heads * 32
    assert footprint.state == STATE_FACTOR * weights
    assert footprint.activations == 3 * 32 * text.num_hidden_layers * per_token_layer * 4
    assert footprint.teacher == 1234
    assert footprint.total == footprint.state + footprint.activations + 1234
    half = full_footprint(model.to(torch.bfloat16), config)
    assert (half.state, half.activations, half.teacher) == (footprint.state // 2, footprint.activations // 2, 0)


def test_frozen_embeddings_hold_no_training_state():
    """`train_embeddings=False` takes the tables' bytes out of the state (a tied table once), nothing else."""
    for model, tables in (
        (tiny_models.tiny_llama_gqa(), ("model.embed_tokens.weight", "lm_head.weight")),
        (tiny_models.tiny_gemma3_text(), ("model.embed_tokens.weight",)),
    ):
        sizes = dict(model.named_parameters())
        table_bytes = sum(sizes[name].numel() * 4 for name in tables)
        assert embedding_bytes(model) == table_bytes
        trained, frozen = (full_footprint(model, RecoveryConfig(train_embeddings=t)) for t in (True, False))
        assert trained.state - frozen.state == STATE_FACTOR * table_bytes
        assert (trained.activations, trained.teacher) == (frozen.activations, frozen.teacher)


def test_full_fits_within_the_headroom_of_the_free_memory(monkeypatch):
    from optimum_flatten.recovery import footprint as module

    model = tiny_models.tiny_llama_gqa()
    config = RecoveryConfig()
    total = full_footprint(model, config).total
    monkeypatch.setattr(module, "available_bytes", lambda device: int(total / HEADROOM) + 1)
    fits, line = full_fits(model, config, teacher_bytes=0)
    assert fits and line.endswith("fits within 90% of it") and "GiB free on cpu" in line
    fits, line = full_fits(model, config, teacher_bytes=2)
    assert not fits and line.endswith("does not fit within 90% of it")


def test_a_loaded_teacher_adds_nothing_and_one_to_load_is_sized_from_the_plan():
    model = tiny_models.tiny_llama_gqa()
    weights = weight_bytes(model)
    assert teacher_bytes_to_load(model, tiny_models.tiny_llama_gqa(), None) == 0
    assert teacher_bytes_to_load(model, "smollm2", None) == 2 * weights
    plan = {"num_layers": 6, "groups": [[0], [1, 2], [3], [5]], "rule": "flatten_prune", "stack": "decoder"}
    assert teacher_bytes_to_load(model, "smollm2", {"plan": plan}) == -(-weights * 6 // 4)


def test_free_memory_is_read_for_the_cpu_and_refused_for_a_device_it_cannot_read():
    assert available_bytes("cpu") > 0
    with pytest.raises(ValueError, match="cannot read the free memory of a 'meta' device"):
        available_bytes("meta")


@pytest.mark.gpu
def test_free_memory_on_cuda_is_the_drivers():
    free, _ = torch.cuda.mem_get_info()
    assert abs(available_bytes("cuda") - free) < 64 * 2**20
