"""Compress on load through transformers' quantizer registration."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer


def _config(**kwargs):
    return FlattenConfig(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, **kwargs)


def test_registration_is_idempotent():
    import importlib

    import optimum_flatten
    from optimum_flatten.integration import register

    register()
    importlib.reload(optimum_flatten)
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["flatten"].__name__ == "FlattenHfQuantizer"


def test_compress_on_load_equals_explicit_quantizer_and_saves_plain(tmp_path):
    dense_dir = tmp_path / "dense"
    tiny_models.tiny_qwen2().save_pretrained(dense_dir)
    tokenizer = tiny_models.CharTokenizer()

    loaded = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=_config(tokenizer=tokenizer))
    explicit = AutoModelForCausalLM.from_pretrained(dense_dir)
    quantizer = FlattenQuantizer(_config(), progress=False)
    quantizer.compress(explicit, tokenizer)

    assert loaded.config.num_hidden_layers == 4
    assert loaded.flatten_report["plan"] == quantizer.report["plan"]
    assert not hasattr(loaded.config, "quantization_config")
    assert getattr(loaded, "hf_quantizer", None) is None and not loaded.is_quantized
    ids = sample_ids()
    assert_close(logits(loaded, ids), logits(explicit, ids))
    # The compressed model must not claim the dense checkpoint as its base.
    assert loaded.name_or_path != str(dense_dir)

    out = tmp_path / "saved"
    loaded.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert_close(logits(reloaded, ids), logits(loaded, ids))


def test_quantizer_save_makes_the_saved_directory_the_base(tmp_path):
    model = tiny_models.tiny_llama_gqa()
    model.config._name_or_path = "some/dense-checkpoint"
    quantizer = FlattenQuantizer(_config(), progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert quantizer.report["base_model"] == "some/dense-checkpoint"
    assert model.name_or_path == ""
    path = quantizer.save(model, tmp_path / "out")
    assert model.name_or_path == str(path)
    reloaded = AutoModelForCausalLM.from_pretrained(model.name_or_path)
    assert_close(logits(reloaded, sample_ids()), logits(model, sample_ids()))


def test_optimum_quantizer_contract(tmp_path):
    from optimum.quantization_base import OptimumQuantizer

    dense_dir = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense_dir)
    tokenizer = tiny_models.CharTokenizer()
    quantizer = FlattenQuantizer.from_pretrained(dense_dir, tokenizer=tokenizer)
    assert isinstance(quantizer, OptimumQuantizer)
    out = quantizer.quantize(save_dir=tmp_path / "out", quantization_config=_config())
    explicit = AutoModelForCausalLM.from_pretrained(dense_dir)
    FlattenQuantizer(_config(), progress=False).compress(explicit, tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.num_hidden_layers == 4
    assert_close(logits(reloaded, sample_ids()), logits(explicit, sample_ids()))
    with pytest.raises(ValueError, match="not empty"):
        quantizer.quantize(save_dir=out, quantization_config=_config())


@pytest.mark.parametrize("method", ["flattengpt", "shortgpt", "sleb", "laco", "sliding_window"])
def test_compress_on_load_with_dtype_and_device_map_for_every_method(tmp_path, method):
    import torch

    dense_dir = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense_dir)
    extra = {"threshold": None} if method == "laco" else {}
    model = AutoModelForCausalLM.from_pretrained(
        dense_dir,
        dtype=torch.bfloat16,
        device_map="cpu",
        quantization_config=_config(method=method, tokenizer=tiny_models.CharTokenizer(), **extra),
    )
    assert model.config.num_hidden_layers == 4 and model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.flatten_report["method"] == method
    assert not hasattr(model.config, "quantization_config")


#: factory -> (stack, where its layers sit in the model, layer count, the modules beside them)
DEVICE_MAP_CASES = {
    "llama_gqa": ("decoder", "model.layers", 6, ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"]),
    "gpt2": ("decoder", "transformer.h", 6, ["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"]),
    "bert": ("encoder", "bert.encoder.layer", 6, ["bert.embeddings", "cls"]),
    "marian_decoder": ("decoder", "model.decoder.layers", 4, ["model.shared", "model.encoder.layers.1", "lm_head"]),
    "marian_encoder": ("encoder", "model.encoder.layers", 5, ["model.shared", "model.decoder.layers.1", "lm_head"]),
}


@pytest.mark.parametrize("case", sorted(DEVICE_MAP_CASES))
def test_device_map_keys_of_every_family_follow_the_kept_layers(case):
    """A per-layer hf_device_map (one entry per layer, some split into submodules) is renumbered exactly: kept
    layers move to their new index, dropped and merged-away layers disappear, other stacks and modules stay."""
    from optimum_flatten import get_adapter
    from optimum_flatten.plan import LayerPlan

    stack, path, count, others = DEVICE_MAP_CASES[case]
    model = tiny_models.FACTORIES[case.split("_")[0] if case.startswith("marian") else case]()
    device_map = {name: "cpu" for name in others}
    device_map.update({f"{path}.{i}": f"cpu:{i}" for i in range(count)})
    device_map[f"{path}.{count - 1}.mlp"] = "disk"  # a layer split over devices keeps its submodule keys
    model.hf_device_map = dict(device_map)
    # Drop layer 2 and merge layer 1 into layer 0: the output layers start at original 0, 3, 4, ..., count - 1.
    plan = LayerPlan(num_layers=count, groups=[[0, 1], *[[i] for i in range(3, count)]], stack=stack)
    adapter = get_adapter(model)
    adapter.keep_layers_(stack, plan.first_indices)

    model.hf_device_map = adapter.renumber_module_keys(model.hf_device_map, stack, plan.first_indices)

    expected = {name: "cpu" for name in others}
    expected.update({f"{path}.{new}": f"cpu:{old}" for new, old in enumerate(plan.first_indices)})
    expected[f"{path}.{count - 3}.mlp"] = "disk"
    assert model.hf_device_map == expected


@pytest.mark.parametrize("door", ["compress_on_load", "api"])
@pytest.mark.parametrize("factory", ["llama_gqa", "gpt2"])
def test_compression_renumbers_a_per_layer_device_map(tmp_path, factory, door):
    """Loaded with one device_map entry per layer (odd layers on disk, so that transformers dispatches and records
    `hf_device_map` before compressing), the compressed model's map names exactly its kept layers, each on the
    device its original layer had: through compress-on-load and `FlattenQuantizer.compress` alike (the API used to
    leave the removed layers in the map)."""
    dense_dir = tmp_path / "dense"
    tiny_models.FACTORIES[factory]().save_pretrained(dense_dir)
    _, path, count, others = DEVICE_MAP_CASES[factory]
    layer_devices = {f"{path}.{i}": "disk" if i % 2 else "cpu" for i in range(count)}
    config = _config(method="shortgpt", tokenizer=tiny_models.CharTokenizer())
    model = AutoModelForCausalLM.from_pretrained(
        dense_dir,
        device_map={name: "cpu" for name in others} | layer_devices,
        offload_folder=tmp_path / "offload",
        **({"quantization_config": config} if door == "compress_on_load" else {}),
    )
    if door == "api":
        quantizer = FlattenQuantizer(config, progress=False)
        quantizer.compress(model, config.tokenizer)
        model.flatten_report = quantizer.report
    first_indices = [group[0] for group in model.flatten_report["plan"]["groups"]]
    expected = {name: "cpu" for name in others}
    expected.update({f"{path}.{new}": layer_devices[f"{path}.{old}"] for new, old in enumerate(first_indices)})
    assert len(first_indices) == 4 and model.hf_device_map == expected


def test_layer_collapse_is_refused_on_load_before_any_weight_loads(tmp_path):
    """Collapsed MLPs need optimum-flatten's export, which from_pretrained + save_pretrained would bypass."""
    dense_dir = tmp_path / "dense"
    tiny_models.tiny_gpt2().save_pretrained(dense_dir)
    config = FlattenConfig(method="layer_collapse", measure_error=False)
    with pytest.raises(ValueError, match=r"cannot run inside from_pretrained.*FlattenQuantizer\.save"):
        AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=config)
