"""A remote-code LayerCollapse checkpoint reloaded with trust_remote_code can be trained, collapsed and saved again.

The reloaded model's class is the checkpoint's own subclass and its α activations the file's own module; the
adapter registry serves it as its stock family and turns those activations into ParametricActivations, with the
same function and the same state-dict names.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoModel, AutoModelForCausalLM, BertModel, GPT2LMHeadModel

import tiny_models
from common import assert_close, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.methods.layer_collapse import (
    CollapseAlpha,
    ParametricActivation,
    parametric_activations,
    prepare_layer_collapse_,
    prepared_mlps,
    save_layer_collapse,
)
from optimum_flatten.methods.layer_collapse.mlp import is_mlp_collapsed
from optimum_flatten.utils.torch_utils import count_parameters


def _directory(tmp_path, name: str):
    # transformers caches remote code under the directory's base name: keep it unique across the test session.
    return tmp_path / f"{tmp_path.name}-{name}"


def _collapse(model) -> None:
    FlattenQuantizer(FlattenConfig(method="layer_collapse", measure_error=False), progress=False).compress(model)


def test_a_reloaded_mid_training_gpt2_resumes_and_saves_as_stock_once_fully_collapsed(tmp_path):
    ids = sample_ids()
    model = tiny_models.tiny_gpt2()
    for activation in prepare_layer_collapse_(model, num_mlps=6).values():
        activation.alpha.data.fill_(0.3)
    expected = logits(model, ids)
    saved = save_layer_collapse(model, _directory(tmp_path, "midtraining"))
    reloaded = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True).eval()
    assert type(reloaded).__name__ == "LayerCollapseGPT2LMHeadModel"
    assert not parametric_activations(reloaded)  # the file's own activation class, before adoption
    before = logits(reloaded, ids)
    assert_close(before, expected)  # the reload (its own attention kernel choice) is equal to tolerance

    prepared = prepared_mlps(get_adapter(reloaded), "decoder")  # get_adapter adopts them
    assert sorted(prepared) == list(range(6))
    assert all(isinstance(a, ParametricActivation) and isinstance(a.alpha, CollapseAlpha) for a in prepared.values())
    assert all(a.alpha.item() == torch.tensor(0.3).item() for a in prepared.values())
    assert torch.equal(logits(reloaded, ids), before)  # adoption is the same function, bit for bit
    assert len(parametric_activations(reloaded)) == 6  # what LayerCollapseTrainer / AdamLC train

    # Training would bring alpha to 1 (set here), then the collapse and a save: every MLP collapsed -> stock GPT-2.
    for model_ in (model, reloaded):
        for activation in prepared_mlps(get_adapter(model_), "decoder").values():
            activation.alpha.data.fill_(1.0)
        _collapse(model_)
    assert_close(logits(reloaded, ids), logits(model, ids))
    final = save_layer_collapse(reloaded, _directory(tmp_path, "final"))
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert "auto_map" not in config and "layer_collapse" not in config
    assert not list(final.glob("*.py"))
    plain = GPT2LMHeadModel.from_pretrained(final).eval()
    assert_close(logits(plain, ids), logits(model, ids))


def test_a_reloaded_partly_collapsed_encoder_collapses_more_and_keeps_its_layout(tmp_path):
    """BertModel without pooler, last MLP collapsed: reload, collapse one more, save (remote code again), reload:
    the stock classes are written (not the file's subclasses), the pooler stays absent, outputs equal."""
    model = tiny_models.tiny_bert().bert
    for activation in prepare_layer_collapse_(model, num_mlps=1).values():
        activation.alpha.data.fill_(1.0)
    _collapse(model)
    first = save_layer_collapse(model, _directory(tmp_path, "first"))
    reloaded = AutoModel.from_pretrained(first, trust_remote_code=True).eval()
    assert reloaded.pooler is None and count_parameters(reloaded) == count_parameters(model)

    for model_ in (model, reloaded):  # num_mlps counts MLPs not collapsed yet: the one below the last
        for activation in prepare_layer_collapse_(model_, num_mlps=1).values():
            activation.alpha.data.fill_(1.0)
        _collapse(model_)
    adapter = get_adapter(reloaded)
    assert [b.index for b in adapter.blocks() if is_mlp_collapsed(b)] == [4, 5]
    second = save_layer_collapse(reloaded, _directory(tmp_path, "second"))
    config = json.loads((second / "config.json").read_text())
    assert config["model_type"] == "bert_layer_collapse"
    assert config["architectures"] == ["LayerCollapseBertModel"]
    assert config["auto_map"]["AutoModel"] == "modeling_layer_collapse_bert.LayerCollapseBertModel"
    assert config["layer_collapse"]["absent"] == ["pooler"]
    again = AutoModel.from_pretrained(second, trust_remote_code=True).eval()
    assert isinstance(again, BertModel) and again.pooler is None
    assert count_parameters(again) == count_parameters(model)
    ids = sample_ids()
    with torch.no_grad():
        assert_close(again(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
