"""Compressing a model whose layers accelerate offloads equals compressing it in memory, and stays offloaded.

The device map spreads the layers over two placements, CPU and disk (read lazily from the checkpoint's safetensors
shards), which is how a model larger than memory is loaded; the calibration engine must onload one layer at a time
and every method must give the same plan and the same weights as with the model in memory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate.hooks import AlignDevicesHook
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.utils.offload import detached_copy, dispatch_like, is_offloaded

NUM_LAYERS = 6
DISK_LAYERS = {1, 3, 4}


def _device_map() -> dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i in DISK_LAYERS else "cpu" for i in range(NUM_LAYERS)})
    return device_map


@pytest.fixture
def dense_dir(tmp_path):
    path = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(path)
    return path


def _offloaded(dense_dir, tmp_path):
    return AutoModelForCausalLM.from_pretrained(dense_dir, device_map=_device_map(), offload_folder=tmp_path / "off")


def _config(method: str) -> FlattenConfig:
    """`method`, `method+correction` (a linear replacement or a compensation on top), or `method/option=value`."""
    method, _, option = method.partition("/")
    method, _, correction = method.partition("+")
    extra: dict[str, Any] = dict([option.split("=")]) if option else {}
    extra |= {"threshold": None, "search_steps": 4} if method in ("laco", "sliding_window") else {}
    if correction:
        extra["compensation" if correction == "scale" else "linear_replacement"] = correction
    return FlattenConfig(
        method=method, num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, **extra
    )


@pytest.mark.parametrize(
    "method",
    [
        "flattengpt",
        "flattengpt/selection=loss",
        "flattengpt/attention_target=parallel",
        "laco",
        "sliding_window",
        "shortgpt",
        "sleb",
        "replaceme",
        "greedy_replace",
        "shortgpt+lstsq",
        "uidl+scale",
        "come",
    ],
)
def test_offloaded_compression_equals_in_memory_compression(dense_dir, tmp_path, method):
    tokenizer = tiny_models.CharTokenizer()
    in_memory = AutoModelForCausalLM.from_pretrained(dense_dir)
    reference = FlattenQuantizer(_config(method), progress=False)
    reference.compress(in_memory, tokenizer)

    offloaded = _offloaded(dense_dir, tmp_path)
    quantizer = FlattenQuantizer(_config(method), progress=False)
    quantizer.compress(offloaded, tokenizer)

    assert quantizer.plan == reference.plan
    if method == "replaceme":  # held in memory, not beside offloaded layers (whose fit holds its own states)
        assert reference.report["held_states"] and "held_states" not in quantizer.report
    if method.startswith("flattengpt"):
        for ours, theirs in zip(quantizer.report["groups"], reference.report["groups"], strict=True):
            assert ours["kept_kv_groups"] == theirs["kept_kv_groups"]
            assert ours["kept_channels_per_member"] == theirs["kept_channels_per_member"]
    ids = sample_ids()
    assert_close(logits(offloaded, ids), logits(in_memory, ids))

    # Nothing that was on disk was brought into memory for good: a layer at a disk position (new or original)
    # keeps its weights on the meta device between forwards.
    kept = reference.plan.first_indices
    for position, original in enumerate(kept):
        layer = offloaded.model.layers[position]
        assert is_offloaded(layer) == (original in DISK_LAYERS), (position, original)

    saved = quantizer.save(offloaded, tmp_path / "out", tokenizer)
    expected = in_memory.state_dict()
    state = load_file(saved / "model.safetensors")
    assert set(state) == {k for k in expected if k != "lm_head.weight" or k in state}
    for name, tensor in state.items():
        assert_close(tensor, expected[name])
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert_close(logits(reloaded, ids), logits(in_memory, ids))


def test_detached_copy_of_an_offloaded_layer_is_plain_and_leaves_the_original_offloaded(dense_dir, tmp_path):
    offloaded = _offloaded(dense_dir, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(dense_dir)
    layer = offloaded.model.layers[1]
    copy = detached_copy(layer)
    assert not any(hasattr(m, "_hf_hook") for m in copy.modules())
    assert all(p.device.type == "cpu" for p in copy.parameters())
    expected = plain.model.layers[1].state_dict()
    assert set(copy.state_dict()) == set(expected)
    for name, tensor in copy.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert is_offloaded(layer) and layer.self_attn.q_proj.weight.device.type == "meta"
    with torch.no_grad():
        copy.self_attn.q_proj.weight.zero_()  # the copy owns its tensors
    assert_close(logits(offloaded, sample_ids()), logits(plain, sample_ids()))


def test_dispatch_like_moves_activations_like_the_block_it_replaces():
    from accelerate.hooks import add_hook_to_module

    reference = torch.nn.Linear(4, 4)
    add_hook_to_module(reference, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    block = dispatch_like(torch.nn.Linear(4, 4), reference)
    hook = block._hf_hook
    assert isinstance(hook, AlignDevicesHook) and hook.io_same_device and str(hook.execution_device) == "cpu"
    untouched = torch.nn.Linear(4, 4)
    assert dispatch_like(untouched, torch.nn.Linear(4, 4)) is untouched
    assert not hasattr(untouched, "_hf_hook")


def test_cpu_offloaded_model_compresses_like_in_memory(dense_dir):
    """accelerate's cpu_offload keeps weights in a RAM state dict and parameters on meta (the GPU setting's CPU
    offload); new blocks must go back to that kind of offload, not to disk."""
    from accelerate import cpu_offload

    tokenizer = tiny_models.CharTokenizer()
    in_memory = AutoModelForCausalLM.from_pretrained(dense_dir)
    reference = FlattenQuantizer(_config("flattengpt"), progress=False)
    reference.compress(in_memory, tokenizer)

    offloaded = cpu_offload(AutoModelForCausalLM.from_pretrained(dense_dir), execution_device="cpu")
    assert is_offloaded(offloaded.model.layers[0])
    quantizer = FlattenQuantizer(_config("flattengpt"), progress=False)
    quantizer.compress(offloaded, tokenizer)
    assert quantizer.plan == reference.plan
    assert all(is_offloaded(layer) for layer in offloaded.model.layers)
    ids = sample_ids()
    assert_close(logits(offloaded, ids), logits(in_memory, ids))
