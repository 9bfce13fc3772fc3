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


def test_load_pretrained_resolves_a_remote_code_checkpoint_through_its_auto_map(tmp_path):
    """A partly collapsed BertForMaskedLM is written with remote code; load_pretrained goes through the Auto class
    its auto_map lists (AutoModelForMaskedLM, not AutoModelForCausalLM) and gets equal logits."""
    from optimum_flatten.methods.layer_collapse import (
        collapse_prepared_mlps_,
        prepare_layer_collapse_,
        save_layer_collapse,
    )

    model = tiny_models.tiny_bert()
    for activation in prepare_layer_collapse_(model, num_mlps=2).values():
        activation.alpha.data.fill_(1.0)
    collapse_prepared_mlps_(model)
    path = save_layer_collapse(model, tmp_path / "out")
    loaded = load_pretrained(str(path), trust_remote_code=True)
    assert type(loaded).__name__ == "LayerCollapseBertForMaskedLM" and not loaded.training
    ids = torch.randint(3, tiny_models.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_public_base_name_never_gives_a_local_path(tmp_path, monkeypatch):
    from optimum_flatten.utils.loading import public_base_name

    local = tmp_path / "models" / "my-dense"
    local.mkdir(parents=True)
    assert public_base_name(str(local)) == ("my-dense", False)
    assert public_base_name(str(tmp_path / "gone" / "dense")) == ("dense", False)  # moved away since
    assert public_base_name("./dense") == ("dense", False)
    snapshot = tmp_path / "hub" / "models--org--some-model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert public_base_name(str(snapshot)) == ("org/some-model", True)  # the Hub cache gives the repo id back
    assert public_base_name("org/some-model") == ("org/some-model", True)
    assert public_base_name("gpt2") == ("gpt2", True)
    assert public_base_name("") == ("unknown", False)
    monkeypatch.chdir(tmp_path / "models")
    assert public_base_name("my-dense") == ("my-dense", False)  # a folder here, not a Hub id
    assert public_base_name(".") == ("models", False)


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("org/model", True),
        ("gpt2", True),
        ("./model", False),
        ("a/b/c", False),
        ("../x", False),
        ("/abs", False),
        ("~/x", False),
        ("org/mo..del", False),
        ("org--x/y", False),
    ],
)
def test_what_counts_as_a_hub_name(name, hub):
    from optimum_flatten.utils.loading import looks_like_hub_id

    assert looks_like_hub_id(name) is hub


def test_load_pretrained_refuses_a_missing_folder_without_the_hub(tmp_path, monkeypatch):
    from optimum_flatten.utils.errors import ModelSourceError

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda *a, **k: pytest.fail("asked the Hub"))
    with pytest.raises(ModelSourceError, match="no such folder"):
        load_pretrained(str(tmp_path / "missing"))


def test_public_dataset_name_never_gives_a_local_path(tmp_path):
    from optimum_flatten.utils.loading import public_dataset_name

    local = tmp_path / "data" / "calib.jsonl"
    local.parent.mkdir()
    local.write_text("{}")
    assert public_dataset_name(str(local)) == "calib.jsonl"
    assert public_dataset_name(local.parent) == "data"
    assert public_dataset_name("./gone/corpus.txt") == "corpus.txt"
    assert public_dataset_name("sotu:before-2000") == "sotu:before-2000"
    assert public_dataset_name("wikitext2") == "wikitext2"
    assert public_dataset_name(["a", "b"]) == "<2 texts>"
