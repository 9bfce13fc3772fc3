"""`FlattenQuantizer.quantize`, optimum's entry point, called as users call it: without a config, with a dict, again
after a refusal and again after a compression."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

import tiny_models
from optimum_flatten import FlattenConfig, FlattenQuantizer


def _bound(tmp_path) -> FlattenQuantizer:
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    return FlattenQuantizer.from_pretrained(dense, tokenizer=tiny_models.CharTokenizer())


def _options(**extra):
    return dict(
        method="shortgpt", num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, **extra
    )


def test_quantize_without_a_config_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"no FlattenConfig: pass quantize\(quantization_config=...\)"):
        _bound(tmp_path).quantize(save_dir=tmp_path / "out")
    with pytest.raises(TypeError, match="quantize needs a FlattenConfig, got list"):
        _bound(tmp_path).quantize(save_dir=tmp_path / "out", quantization_config=["shortgpt"])


def test_quantize_takes_a_dict_as_from_pretrained_does(tmp_path):
    out = _bound(tmp_path).quantize(save_dir=tmp_path / "out", quantization_config=_options())
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4


def test_a_retry_after_a_refusal_starts_from_the_dense_model(tmp_path):
    quantizer = _bound(tmp_path)
    bad = FlattenConfig(**_options(heal={"max_tokens": 256, "mode": "lora", "target_modules": ["qkv_proj"]}))
    with pytest.raises(ValueError, match="name no module"):
        quantizer.quantize(save_dir=tmp_path / "out", quantization_config=bad)
    out = quantizer.quantize(save_dir=tmp_path / "out", quantization_config=FlattenConfig(**_options()))
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4


def test_a_second_quantize_does_not_compress_the_compressed_model_again(tmp_path):
    quantizer = _bound(tmp_path)
    quantizer.quantize(save_dir=tmp_path / "a", quantization_config=FlattenConfig(**_options()))
    with pytest.raises(ValueError, match=r"already compressed this quantizer's model"):
        quantizer.quantize(save_dir=tmp_path / "b", quantization_config=FlattenConfig(**_options()))
    assert quantizer.model.config.num_hidden_layers == 4 and not (tmp_path / "b").exists()
