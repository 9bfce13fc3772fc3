"""config.json / tokenizer_config.json that transformers 4.x reads the same way (``compat="v4"``, the default).

transformers 5 writes RoPE settings only as ``rope_parameters``; 4.x reads the top-level ``rope_theta`` (and
``rope_scaling``) and silently falls back to 10000 without them. These tests parse the saved files the way 4.x does
(top-level keys) and check that transformers 5 still reloads the very same model and config.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten.export.checkpoint import add_v4_compat, save_compressed


def _compressed(factory: str = "llama_gqa"):
    model = tiny_models.FACTORIES[factory]()
    return model, compress(model, "shortgpt", num_layers_to_remove=2, nsamples=4, seqlen=16)


def _read(path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _comparable(config) -> dict:
    """A config as a dict, without the keys that name where it was loaded from."""
    data = config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        data.pop(key, None)
    return data


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_v4_keys_are_written_and_transformers_5_reloads_the_same(tmp_path, factory):
    model, quantizer = _compressed(factory)
    report = quantizer.report
    tokenizer = tiny_models.tiny_hf_tokenizer()
    v4 = save_compressed(model, tmp_path / "v4", tokenizer=tokenizer, report=report)
    plain = save_compressed(model, tmp_path / "plain", tokenizer=tokenizer, report=report, compat=None)

    config = _read(v4 / "config.json")
    # What 4.x reads: the top-level key, equal to the value transformers 5 keeps in rope_parameters.
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert "rope_scaling" not in config or config["rope_scaling"] is None  # default RoPE: 4.x wants none
    assert "rope_theta" not in _read(plain / "config.json")
    tokenizer_config = _read(v4 / "tokenizer_config.json")
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert _read(plain / "tokenizer_config.json")["tokenizer_class"] == "TokenizersBackend"

    # transformers 5: the same config as without the extra keys, and the same logits as the model in memory.
    assert _comparable(AutoConfig.from_pretrained(v4)) == _comparable(AutoConfig.from_pretrained(plain))
    ids = sample_ids()
    with_keys, without = (
        logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids) for path in (v4, plain)
    )
    assert torch.equal(with_keys, without)
    assert_close(with_keys, logits(model, ids))  # the reload may pick another attention kernel than the tiny model
    # The tokenizer transformers 5 builds from either folder is the same (for a qwen2 checkpoint it picks
    # Qwen2Tokenizer by model_type whatever tokenizer_class says, in both).
    text = "state of the union"
    v4_tokenizer, plain_tokenizer = AutoTokenizer.from_pretrained(v4), AutoTokenizer.from_pretrained(plain)
    assert type(v4_tokenizer) is type(plain_tokenizer)
    assert v4_tokenizer(text)["input_ids"] == plain_tokenizer(text)["input_ids"]


def test_scaled_rope_gets_rope_scaling_as_4x_names_it(tmp_path):
    config = LlamaConfig(
        **{**tiny_models._common(num_key_value_heads=2), "rope_parameters": None},
        rope_theta=50000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    model = tiny_models._build(config, seed=0)
    assert model.config.rope_parameters["rope_type"] == "linear"
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "v4")
    added = add_v4_compat(tmp_path / "v4")
    assert added == ["config.json: rope_theta", "config.json: rope_scaling"]
    saved = _read(tmp_path / "v4" / "config.json")
    assert saved["rope_theta"] == 50000.0
    assert saved["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert _comparable(AutoConfig.from_pretrained(tmp_path / "v4")) == _comparable(
        AutoConfig.from_pretrained(tmp_path / "plain")
    )
    # Idempotent: a second pass adds nothing and changes nothing.
    assert add_v4_compat(tmp_path / "v4") == []


def test_models_without_rope_get_no_rope_keys(tmp_path):
    model = tiny_models.tiny_gpt2()
    model.save_pretrained(tmp_path)
    assert add_v4_compat(tmp_path) == []
    assert "rope_theta" not in _read(tmp_path / "config.json")


def test_compat_is_checked(tmp_path):
    with pytest.raises(ValueError, match="compat must be"):
        save_compressed(tiny_models.tiny_llama_gqa(), tmp_path / "out", compat="v3")


def _scaled_gemma3(multimodal: bool):
    """Gemma 3 as released at 4B and up: linear RoPE scaling (factor 8) on its full-attention layers only."""
    model = tiny_models.tiny_gemma3() if multimodal else tiny_models.tiny_gemma3_text()
    text = model.config.get_text_config()
    text.rope_parameters = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return model


@pytest.mark.parametrize("multimodal", [False, True])
def test_gemma3_per_layer_type_rope_gets_the_keys_4x_reads(tmp_path, multimodal):
    """4.x's Gemma3TextConfig reads rope_theta and rope_scaling for the full-attention layers and
    rope_local_base_freq for the sliding ones; without them it runs unscaled RoPE at 4.x's default thetas. An image-text
    model keeps them in text_config. transformers 5 reloads the same config and the same logits."""
    model = _scaled_gemma3(multimodal)
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "v4")
    where = "text_config." if multimodal else ""
    added = add_v4_compat(tmp_path / "v4")
    assert added == [f"config.json: {where}{k}" for k in ("rope_theta", "rope_local_base_freq", "rope_scaling")]
    saved = _read(tmp_path / "v4" / "config.json")
    saved = saved["text_config"] if multimodal else saved
    assert (saved["rope_theta"], saved["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert saved["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    v4, plain = AutoConfig.from_pretrained(tmp_path / "v4"), AutoConfig.from_pretrained(tmp_path / "plain")
    assert v4.get_text_config().rope_parameters == plain.get_text_config().rope_parameters
    assert add_v4_compat(tmp_path / "v4") == []
    if not multimodal:
        ids = sample_ids()
        reloaded = [logits(AutoModelForCausalLM.from_pretrained(tmp_path / f).eval(), ids) for f in ("v4", "plain")]
        assert torch.equal(*reloaded)
