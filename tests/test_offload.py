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
from common import assert_close, logits, sample_ids, tiny_config
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.utils.errors import UnsupportedArchitectureError
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
    extra |= {"batch_size": 4} if method == "auto" else {}  # a batch to fit, one to choose on
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
        "flattengpt+lstsq_down",  # read an offloaded down projection's meta weight after the layers were dropped
        "sleb+lstsq_down",
        "uidl+scale",
        "come",
        "auto",  # its candidates include lstsq_down
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


def test_the_weights_fingerprint_reads_offloaded_layers_so_a_resume_knows_the_model_whatever_the_device_map(
    dense_dir, tmp_path
):
    """Resume and the teacher check recognise a model by `weights_fingerprint`: an offloaded layer's parameters sit
    on the meta device, and counting them by shape alone let another model's state be resumed when its differing
    layers were offloaded, and refused the same model loaded with another device map."""
    from optimum_flatten.utils.fingerprint import weights_fingerprint

    in_memory = AutoModelForCausalLM.from_pretrained(dense_dir)
    offloaded = _offloaded(dense_dir, tmp_path)
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # some layers are on disk
    assert weights_fingerprint(offloaded) == weights_fingerprint(in_memory)
    other = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        for parameter in other.model.layers[min(DISK_LAYERS)].parameters():  # a layer the map puts on disk
            parameter.add_(0.05)
    other.save_pretrained(tmp_path / "other")
    changed = AutoModelForCausalLM.from_pretrained(
        tmp_path / "other", device_map=_device_map(), offload_folder=tmp_path / "off_other"
    )
    assert weights_fingerprint(changed) != weights_fingerprint(offloaded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_offloaded_weight_is_sampled_from_its_leading_rows_as_read_whole(tmp_path, dtype):
    """A `.dat` file (accelerate's own offload) and a safetensors file: the rows read give the same first values as
    the weight read whole, for a matrix whose rows are shorter than the sample, a vector and a scalar."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, offload_state_dict
    from safetensors.torch import save_file

    from optimum_flatten.utils.fingerprint import SAMPLE, _leading_values

    generator = torch.Generator().manual_seed(0)
    state = {
        "block.narrow": torch.randn(50, 3, generator=generator).to(dtype),
        "block.vector": torch.randn(100, generator=generator).to(dtype),
        "block.scalar": torch.tensor(2.5).to(dtype),
    }
    offload_state_dict(str(tmp_path / "dat"), state)
    save_file(state, str(tmp_path / "weights.safetensors"))
    index = {name: {"safetensors_file": str(tmp_path / "weights.safetensors"), "weight_name": name} for name in state}
    for loader in (OffloadedWeightsLoader(save_folder=str(tmp_path / "dat")), OffloadedWeightsLoader(index=index)):
        weights = PrefixedDataset(loader, "block.")
        for name, tensor in state.items():
            got = _leading_values(weights, name.removeprefix("block."))
            assert got.dtype == dtype and torch.equal(got.reshape(-1)[:SAMPLE], tensor.reshape(-1)[:SAMPLE])
            assert got.numel() <= max(SAMPLE + 3, 1)  # the leading rows, not the whole weight


@pytest.mark.parametrize("correction", ["shortgpt+scale", "replaceme/estimator=lstsq_gain"])
@pytest.mark.parametrize("held", ["model.embed_tokens", "model.norm"])
def test_a_fold_into_offloaded_embeddings_is_refused_before_any_change(dense_dir, tmp_path, correction, held):
    """Compensation and a bridge's stream gain scale the embeddings (and, tied, the final norm) in place; offloaded,
    those writes were lost while the layers kept theirs, and the model computed another function. Refused first.
    The tiny LLaMA's embeddings are untied, so its final norm offloaded alone is not refused."""
    device_map = _device_map() | {held: "disk"}
    model = AutoModelForCausalLM.from_pretrained(dense_dir, device_map=device_map, offload_folder=tmp_path / "off")
    before = {k: v.clone() for k, v in model.state_dict().items() if v.device.type != "meta"}
    quantizer = FlattenQuantizer(_config(correction), progress=False)
    if held == "model.norm":
        quantizer.compress(model, tiny_models.CharTokenizer())
        assert model.config.num_hidden_layers == NUM_LAYERS - 2
        return
    with pytest.raises(UnsupportedArchitectureError, match=r"model\.embed_tokens, which this model keeps offloaded"):
        quantizer.compress(model, tiny_models.CharTokenizer())
    assert model.config.num_hidden_layers == NUM_LAYERS
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_tied_final_norm_offloaded_is_refused_for_a_fold(tmp_path):
    tiny_models.tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "cpu", "lm_head": "cpu"}
    device_map["transformer.ln_f"] = "disk"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", device_map=device_map, offload_folder=tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=r"transformer\.ln_f"):
        FlattenQuantizer(_config("shortgpt+scale"), progress=False).compress(model, tiny_models.CharTokenizer())


def test_healing_an_offloaded_model_is_refused_before_any_change(dense_dir, tmp_path):
    """The compression ran first and the healing then failed moving the offloaded teacher copy (the work lost);
    `recover` failed copying meta weights at its gate and left peft's LoRA modules in the model."""
    from optimum_flatten.options.recovery import RecoveryConfig
    from optimum_flatten.recovery import recover

    offloaded = _offloaded(dense_dir, tmp_path)
    heal = {"max_tokens": 256, "seqlen": 16, "heldout_rows": 0}
    config = tiny_config("shortgpt", num_layers_to_remove=2, heal=heal)
    with pytest.raises(ValueError, match=r"^healing trains weights in memory, and this model has layers offloaded"):
        FlattenQuantizer(config, progress=False).compress(offloaded, tiny_models.CharTokenizer())
    assert len(offloaded.model.layers) == NUM_LAYERS
    for mode in ("full", "lora"):
        with pytest.raises(ValueError, match=r"has layers offloaded to CPU or disk by its device_map"):
            texts, config = tiny_models.sample_texts(), RecoveryConfig(mode=mode, **heal)
            recover(offloaded, tiny_models.CharTokenizer(), texts, config, teacher=False)
        assert not any("lora" in name for name, _ in offloaded.named_modules())


def test_a_model_with_no_weights_behind_its_meta_tensors_is_refused_in_one_line(dense_dir):
    """Built on meta and never loaded (offloaded layers are meta too, but with a hook): the calibration failed with
    "Tensor.item() cannot be called on meta tensors"."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dense_dir))
    message = r"parameters of this LlamaForCausalLM \(the first: model.embed_tokens.weight\) are on the meta device"
    with pytest.raises(ValueError, match=message):
        FlattenQuantizer(_config("shortgpt"), progress=False).compress(model, tiny_models.CharTokenizer())
    assert len(model.model.layers) == NUM_LAYERS


def test_a_block_placed_twice_outlives_the_block_it_replaced(dense_dir, tmp_path):
    """A block edited twice on disk (FlattenGPT's merged block, then lstsq_down's refit) had its folder made inside
    the first new block's, which went with that block when it was collected: a flaky FileNotFoundError later."""
    import gc

    from optimum_flatten.utils.offload import onloaded

    offloaded = _offloaded(dense_dir, tmp_path)
    layers = offloaded.model.layers
    expected = {k: v.clone() for k, v in detached_copy(layers[1]).state_dict().items()}
    layers[1] = dispatch_like(detached_copy(layers[1]), layers[1])  # the first placement: a folder of its own
    layers[1] = dispatch_like(detached_copy(layers[1]), layers[1])  # the second replaces it
    gc.collect()  # the first new block is gone, and its folder with it
    with onloaded(layers[1]):
        for name, tensor in layers[1].state_dict().items():
            assert torch.equal(tensor, expected[name]), name
