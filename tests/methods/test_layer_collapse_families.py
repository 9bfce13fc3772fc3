"""LayerCollapse on the nn.Linear MLP families (BERT, ViT, Marian's two stacks): prepare is exact, collapse at α = 1
equals the linearised model, a fully collapsed model reloads with the plain transformers class, and any other
LayerCollapse model (partly collapsed, α left, or a head the stock config cannot describe) reloads through the
remote-code format in a fresh interpreter without optimum_flatten."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import BertForMaskedLM, BertModel, MarianMTModel, ViTForImageClassification

import tiny_models
from common import assert_close, compress, reload_with_remote_code, sample_ids
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.export.checkpoint import REPORT_NAME, save_compressed
from optimum_flatten.methods.layer_collapse import (
    LayerCollapseExportError,
    collapse_prepared_mlps_,
    prepare_layer_collapse_,
    prepared_mlps,
    save_layer_collapse,
)
from optimum_flatten.methods.layer_collapse.mlp import is_mlp_collapsed
from optimum_flatten.utils.torch_utils import count_parameters

HIDDEN = 32


def _text_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    ids = sample_ids()
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _image_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    return {"pixel_values": tiny_models.sample_pixel_values()}


def _translation_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    source, target = sample_ids(2, 10, seed=1), sample_ids(2, 7, seed=2)
    target[:, 0] = model.config.decoder_start_token_id
    return {"input_ids": source, "decoder_input_ids": target, "use_cache": False}


def _tiny_bert_encoder() -> nn.Module:
    """The encoder of the tiny BertForMaskedLM, a bare BertModel without pooler (what a BERT stock export holds)."""
    return tiny_models.tiny_bert().bert


@dataclass(frozen=True)
class Family:
    """A tiny model factory, its plain reload class, its stacks with (layers, MLP width), how to run it, and the
    Auto class a remote-code checkpoint of it loads through."""

    factory: Callable[[], nn.Module]
    plain_class: type
    stacks: dict[str, tuple[int, int]]
    inputs: Callable[[nn.Module], dict[str, torch.Tensor]]
    field: str = "logits"
    reload_options: tuple[tuple[str, object], ...] = ()
    auto_class: str = ""

    @torch.no_grad()
    def outputs(self, model: nn.Module) -> torch.Tensor:
        return getattr(model(**self.inputs(model)), self.field)


FAMILIES = {
    "bert": Family(
        tiny_models.tiny_bert, BertForMaskedLM, {"encoder": (6, 48)}, _text_inputs, auto_class="AutoModelForMaskedLM"
    ),
    "vit": Family(
        tiny_models.tiny_vit,
        ViTForImageClassification,
        {"encoder": (6, 48)},
        _image_inputs,
        auto_class="AutoModelForImageClassification",
    ),
    "marian": Family(
        tiny_models.tiny_marian,
        MarianMTModel,
        {"encoder": (5, 48), "decoder": (4, 40)},
        _translation_inputs,
        auto_class="AutoModelForSeq2SeqLM",
    ),
}


#: What the stock export writes: BertForMaskedLM's head reads hidden_act too and is refused (see below).
EXPORTED = {
    "bert_encoder": Family(
        _tiny_bert_encoder,
        BertModel,
        {"encoder": (6, 48)},
        _text_inputs,
        "last_hidden_state",
        (("add_pooling_layer", False),),
        "AutoModel",
    ),
    "vit": FAMILIES["vit"],
    "marian": FAMILIES["marian"],
}


def _saved_per_mlp(width: int) -> int:
    """Parameters one collapsed MLP stops holding: up + down (2·d·h + h + d) become one d x d map with bias."""
    return (2 * HIDDEN * width + width + HIDDEN) - (HIDDEN * HIDDEN + HIDDEN)


def _linearise(model: nn.Module, selection: dict[str, int], alpha: float = 1.0) -> None:
    """Prepares the last `selection[stack]` MLPs of each stack and sets their α by hand."""
    for stack, num_mlps in selection.items():
        activations = prepare_layer_collapse_(model, num_mlps=num_mlps, stack=stack)
        with torch.no_grad():
            for activation in activations.values():
                activation.alpha.fill_(alpha)


def _collapse(model: nn.Module, stacks) -> None:
    for stack in stacks:
        collapse_prepared_mlps_(model, stack=stack)


def _all(family: Family) -> dict[str, int]:
    return {stack: num_layers for stack, (num_layers, _) in family.stacks.items()}


# --------------------------------------------------------------------------------------------------- prepare
@pytest.mark.parametrize("name", list(FAMILIES))
def test_prepare_at_alpha_zero_is_exact(name):
    family = FAMILIES[name]
    model = family.factory()
    reference = family.outputs(model)
    _linearise(model, {stack: 2 for stack in family.stacks}, alpha=0.0)
    adapter = get_adapter(model)
    assert all(sorted(prepared_mlps(adapter, s)) == [n - 2, n - 1] for s, (n, _) in family.stacks.items())
    assert torch.equal(family.outputs(model), reference)


# -------------------------------------------------------------------------------------------------- collapse
@pytest.mark.parametrize("name", list(FAMILIES))
def test_collapse_at_alpha_one_equals_the_linearised_model(name):
    """Every stack, last two MLPs: outputs equal the two-map linear MLPs', each merged map is the float64 product of
    the original maps, un-collapsed layers are untouched, and the unique parameter count drops by the two maps."""
    family = FAMILIES[name]
    original, model = family.factory(), family.factory()
    selection = {stack: 2 for stack in family.stacks}
    _linearise(model, selection)
    linearised = family.outputs(model)
    assert not torch.allclose(linearised, family.outputs(original), atol=1e-3)  # the linearisation is no no-op
    _collapse(model, family.stacks)
    assert_close(family.outputs(model), linearised)
    saved = sum(2 * _saved_per_mlp(width) for _, width in family.stacks.values())
    assert count_parameters(model) == count_parameters(original) - saved
    adapter, reference = get_adapter(model), get_adapter(original)
    for stack, (num_layers, _) in family.stacks.items():
        for i in range(num_layers):
            block, before = adapter.block(stack, i), reference.block(stack, i)
            if i < num_layers - 2:
                assert not is_mlp_collapsed(block)
                assert torch.equal(block.mlp.up.weight, before.mlp.up.weight)
                continue
            assert is_mlp_collapsed(block) and isinstance(block.mlp.activation, nn.Identity)
            w1, b1 = before.mlp.up.weight.double(), before.mlp.up.bias.double()
            w2, b2 = before.mlp.down.weight.double(), before.mlp.down.bias.double()
            assert_close(block.mlp.up.weight.double(), w2 @ w1, torch.float32)
            assert_close(block.mlp.up.bias.double(), w2 @ b1 + b2, torch.float32)
    adapter.validate()  # a collapsed MLP is consistent with the config


def test_bert_collapse_through_the_quantizer_measures_the_error():
    model = tiny_models.tiny_bert()
    _linearise(model, {"encoder": 3})
    linearised = FAMILIES["bert"].outputs(model)
    config = FlattenConfig(method="layer_collapse", dataset=tiny_models.sample_texts(), nsamples=4, seqlen=16)
    quantizer = compress(model, config)
    records = quantizer.report["layer_collapse"]["collapsed"]
    assert [r["layer"] for r in records] == [3, 4, 5]
    assert all(r["error_bound"] == 0.0 and r["relative_error"] < 1e-12 for r in records)
    assert_close(FAMILIES["bert"].outputs(model), linearised)


# ---------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("name", list(EXPORTED))
def test_export_all_collapsed_reloads_with_the_plain_class(name, tmp_path):
    family = EXPORTED[name]
    model = family.factory()
    _linearise(model, _all(family))
    _collapse(model, family.stacks)
    expected = family.outputs(model)
    path = save_layer_collapse(model, tmp_path / "out")
    assert json.loads((path / REPORT_NAME).read_text())["export_format"] == "stock"
    adapter = get_adapter(model)
    assert all(is_mlp_collapsed(b) for s in family.stacks for b in adapter.blocks(s))  # save restored them
    reloaded = family.plain_class.from_pretrained(path, **dict(family.reload_options)).eval()
    assert type(reloaded) is family.plain_class
    config = json.loads((path / "config.json").read_text())
    if name == "marian":
        assert config["encoder_ffn_dim"] == config["decoder_ffn_dim"] == HIDDEN
        assert config["activation_function"] == "linear"
    else:
        assert config["intermediate_size"] == HIDDEN and config["hidden_act"] == "linear"
    assert_close(family.outputs(reloaded), expected)
    # The reload carries identity down maps: d² + d more parameters per MLP than the collapsed model in memory.
    num_mlps = sum(n for n, _ in family.stacks.values())
    assert count_parameters(reloaded) == count_parameters(model) + num_mlps * (HIDDEN * HIDDEN + HIDDEN)
    # ...which the report counts for the card (both of Marian's stacks).
    report = json.loads((path / REPORT_NAME).read_text())
    assert report["stock_identity_parameters"] == count_parameters(reloaded) - count_parameters(model)


def _assert_stock_refused(model: nn.Module, tmp_path, match: str) -> None:
    with pytest.raises(LayerCollapseExportError, match=match):
        save_layer_collapse(model, tmp_path / "refused", export_format="stock")
    assert not any(p.name.startswith((".refused", "refused")) for p in tmp_path.iterdir())  # nothing, no staging


def _remote_cases() -> dict[str, tuple[Family, nn.Module, str]]:
    """Per family: partly collapsed (last two MLPs of every stack) and mid-training (α = 0.3 in the last MLP);
    plus the two fully collapsed models the stock format cannot describe. Each with the reason "stock" refuses it."""
    cases = {}
    for name, family in FAMILIES.items():
        partly = family.factory()
        _linearise(partly, {stack: 2 for stack in family.stacks})
        _collapse(partly, family.stacks)
        linearisable = family.factory()
        _linearise(linearisable, {stack: 1 for stack in family.stacks}, alpha=0.3)
        cases[f"{name}_partly"] = (family, partly, "every MLP of every stack collapsed")
        cases[f"{name}_linearisable"] = (family, linearisable, "alpha left")
    encoder = _tiny_bert_encoder()  # a BertModel without pooler: the reload must not add a random one
    _linearise(encoder, {"encoder": 3})
    _collapse(encoder, ["encoder"])
    cases["bert_encoder_partly"] = (EXPORTED["bert_encoder"], encoder, "every MLP of every stack collapsed")
    mlm = tiny_models.tiny_bert()  # BertForMaskedLM: its head reads hidden_act, so "linear" would change it
    _linearise(mlm, {"encoder": 6})
    _collapse(mlm, ["encoder"])
    cases["bert_mlm_all"] = (FAMILIES["bert"], mlm, r"cls\.predictions\.transform.*model\.bert")
    encoder_only = tiny_models.tiny_marian()  # MarianConfig has one activation for both stacks
    _linearise(encoder_only, {"encoder": 5})
    _collapse(encoder_only, ["encoder"])
    cases["marian_encoder_all"] = (FAMILIES["marian"], encoder_only, r"decoder: collapsed \[\] of 4")
    return cases


def test_every_other_layer_collapse_model_reloads_with_remote_code(tmp_path):
    """Partly collapsed, mid-training and stock-inexpressible models of BERT, ViT and Marian: "stock" is refused
    with the reason and nothing written; "auto" writes remote code; a fresh interpreter loads each through the Auto
    class of its head with trust_remote_code (no optimum_flatten import) with equal outputs and equal unique
    parameter counts."""
    jobs, models = {}, {}
    for name, (family, model, reason) in _remote_cases().items():
        _assert_stock_refused(model, tmp_path, reason)
        path = save_layer_collapse(model, tmp_path / name)
        report = json.loads((path / REPORT_NAME).read_text())
        assert report["export_format"] == "remote_code"
        assert report["load_with"] == {"class": family.auto_class, "trust_remote_code": True}
        card = (path / "README.md").read_text()
        assert f"{family.auto_class}.from_pretrained" in card and "trust_remote_code=True" in card
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == [f"LayerCollapse{family.plain_class.__name__}"]
        jobs[name] = (path, family.inputs(model), family.field)
        models[name] = (family, model)
    out = reload_with_remote_code(jobs, tmp_path)
    assert out["imported"] == []
    for name, (family, model) in models.items():
        assert out[name]["auto"] == family.auto_class, name
        assert out[name]["type"] == f"LayerCollapse{family.plain_class.__name__}"
        assert out[name]["model_type"] == f"{model.config.model_type}_layer_collapse"
        assert out[name]["parameters"] == count_parameters(model), name
        assert_close(out[name]["output"], family.outputs(model))


def test_remote_code_of_a_fully_collapsed_model_holds_no_identity_maps(tmp_path):
    """Forcing "remote_code" on a model the stock format describes writes no identity down maps: d² + d fewer
    parameters per MLP than the stock reload, i.e. exactly the collapsed model's count."""
    family = EXPORTED["vit"]
    model = family.factory()
    _linearise(model, _all(family))
    _collapse(model, family.stacks)
    path = save_layer_collapse(model, tmp_path / "remote", export_format="remote_code")
    out = reload_with_remote_code({"vit": (path, family.inputs(model), family.field)}, tmp_path)
    assert out["vit"]["parameters"] == count_parameters(model)
    assert_close(out["vit"]["output"], family.outputs(model))


def test_a_model_class_outside_transformers_is_refused_and_writes_nothing(tmp_path):
    """No modelling file can subclass a class transformers does not define: a clear error, nothing written."""

    class CustomBert(BertForMaskedLM):
        pass

    model = CustomBert(tiny_models.tiny_bert().config)
    _linearise(model, {"encoder": 2})
    _collapse(model, ["encoder"])
    with pytest.raises(LayerCollapseExportError, match=r"CustomBert is not part of transformers.*torch\.save"):
        save_layer_collapse(model, tmp_path / "out")
    with pytest.raises(LayerCollapseExportError, match="not part of transformers"):
        save_compressed(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
