"""Checkpoints load as the class they were saved from, so the CLI and from_pretrained serve every family."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from optimum_flatten.export.model_card import render_model_card
from optimum_flatten.utils.loading import load_pretrained, model_class_for


@pytest.mark.parametrize("factory", ["llama_gqa", "gpt2", "bert", "vit", "marian"])
def test_load_pretrained_keeps_the_saved_class_and_weights(tmp_path, factory):
    model = tiny_models.FACTORIES[factory]()
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(str(tmp_path))
    assert type(loaded) is type(model) and not loaded.training
    expected = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_an_unknown_architecture_name_is_a_clear_error():
    from transformers import LlamaConfig

    config = LlamaConfig(architectures=["NotARealModelClass"])
    with pytest.raises(ValueError, match=r"NotARealModelClass.*trust_remote_code"):
        model_class_for(config)


def test_model_card_says_how_to_load_a_non_causal_model():
    card = render_model_card({"architecture": "MarianMTModel", "method": "shortgpt"})
    assert 'MarianMTModel.from_pretrained("path/or/repo")' in card
    card = render_model_card({"architecture": "LlamaForCausalLM", "method": "shortgpt"})
    assert 'AutoModelForCausalLM.from_pretrained("path/or/repo")' in card
