"""LayerCollapse on the nn.Linear MLP families (BERT, ViT, Marian's two stacks): prepare is exact, collapse at α = 1
equals the linearised model, a fully collapsed model reloads with the plain transformers class, and a partly
collapsed one is refused by the export with nothing written (only GPT-2 has a remote-code format)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import BertForMaskedLM, BertModel, MarianMTModel, ViTForImageClassification

import tiny_models
from common import assert_close, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.export.checkpoint import REPORT_NAME, save_compressed
from optimum_flatten.export.layer_collapse import LayerCollapseExportError, save_layer_collapse
from optimum_flatten.methods.layer_collapse import collapse_prepared_mlps_, prepare_layer_collapse_, prepared_mlps
from optimum_flatten.utils.torch_utils import count_parameters

HIDDEN = 32


@dataclass(frozen=True)
class Family:
    """A tiny model factory, its plain reload class, its stacks with (layers, MLP width), and how to run it."""

    factory: Callable[[], nn.Module]
    plain_class: type
    stacks: dict[str, tuple[int, int]]
    outputs: Callable[[nn.Module], torch.Tensor]
    reload_options: tuple[tuple[str, object], ...] = ()


@torch.no_grad()
def _text_logits(model: nn.Module) -> torch.Tensor:
    ids = sample_ids()
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return model(input_ids=ids, attention_mask=mask).logits


@torch.no_grad()
def _encoder_states(model: nn.Module) -> torch.Tensor:
    ids = sample_ids()
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _tiny_bert_encoder() -> nn.Module:
    """The encoder of the tiny BertForMaskedLM, a bare BertModel without pooler (what a BERT stock export holds)."""
    return tiny_models.tiny_bert().bert


@torch.no_grad()
def _image_logits(model: nn.Module) -> torch.Tensor:
    return model(pixel_values=tiny_models.sample_pixel_values()).logits


@torch.no_grad()
def _translation_logits(model: nn.Module) -> torch.Tensor:
    source, target = sample_ids(2, 10, seed=1), sample_ids(2, 7, seed=2)
    target[:, 0] = model.config.decoder_start_token_id
    return model(input_ids=source, decoder_input_ids=target, use_cache=False).logits


FAMILIES = {
    "bert": Family(tiny_models.tiny_bert, BertForMaskedLM, {"encoder": (6, 48)}, _text_logits),
    "vit": Family(tiny_models.tiny_vit, ViTForImageClassification, {"encoder": (6, 48)}, _image_logits),
    "marian": Family(
        tiny_models.tiny_marian, MarianMTModel, {"encoder": (5, 48), "decoder": (4, 40)}, _translation_logits
    ),
}


#: What the stock export writes: BertForMaskedLM's head reads hidden_act too and is refused (see below).
EXPORTED = {
    "bert_encoder": Family(
        _tiny_bert_encoder, BertModel, {"encoder": (6, 48)}, _encoder_states, (("add_pooling_layer", False),)
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
                assert not adapter.is_mlp_collapsed(block)
                assert torch.equal(block.mlp.up.weight, before.mlp.up.weight)
                continue
            assert adapter.is_mlp_collapsed(block) and isinstance(block.mlp.activation, nn.Identity)
            w1, b1 = before.mlp.up.weight.double(), before.mlp.up.bias.double()
            w2, b2 = before.mlp.down.weight.double(), before.mlp.down.bias.double()
            assert_close(block.mlp.up.weight.double(), w2 @ w1, torch.float32)
            assert_close(block.mlp.up.bias.double(), w2 @ b1 + b2, torch.float32)
    adapter.validate()  # a collapsed MLP is consistent with the config


def test_bert_collapse_through_the_quantizer_measures_the_error():
    model = tiny_models.tiny_bert()
    _linearise(model, {"encoder": 3})
    linearised = _text_logits(model)
    config = FlattenConfig(method="layer_collapse", dataset=tiny_models.sample_texts(), nsamples=4, seqlen=16)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    records = quantizer.report["layer_collapse"]["collapsed"]
    assert [r["layer"] for r in records] == [3, 4, 5]
    assert all(r["error_bound"] == 0.0 and r["relative_error"] < 1e-12 for r in records)
    assert_close(_text_logits(model), linearised)


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
    assert all(adapter.is_mlp_collapsed(b) for s in family.stacks for b in adapter.blocks(s))  # save restored them
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


def _assert_refused(model: nn.Module, tmp_path, **options) -> None:
    with pytest.raises(LayerCollapseExportError, match="only the stock LayerCollapse checkpoint format"):
        save_layer_collapse(model, tmp_path / "out", **options)
    assert list(tmp_path.iterdir()) == []  # no output directory, no staging directory left behind


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_of_a_partly_collapsed_model_is_refused_and_writes_nothing(name, tmp_path):
    family = FAMILIES[name]
    model = family.factory()
    _linearise(model, {stack: 2 for stack in family.stacks})
    _collapse(model, family.stacks)
    _assert_refused(model, tmp_path)
    # Mid-training (α left, nothing collapsed) too, and the save path of the quantizer (save_compressed) alike.
    linearisable = family.factory()
    _linearise(linearisable, {stack: 1 for stack in family.stacks}, alpha=0.3)
    _assert_refused(linearisable, tmp_path)
    with pytest.raises(LayerCollapseExportError, match=r"torch\.save"):
        save_compressed(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_marian_stock_export_needs_both_stacks_fully_collapsed(tmp_path):
    """MarianConfig has one activation_function for both stacks: a fully collapsed encoder alone is refused."""
    model = tiny_models.tiny_marian()
    _linearise(model, {"encoder": 5})
    _collapse(model, ["encoder"])
    _assert_refused(model, tmp_path)
    _assert_refused(model, tmp_path, export_format="stock")


def test_remote_code_format_is_refused_for_a_fully_collapsed_bert(tmp_path):
    model = tiny_models.tiny_bert()
    _linearise(model, {"encoder": 6})
    _collapse(model, ["encoder"])
    _assert_refused(model, tmp_path, export_format="remote_code")


def test_stock_export_of_bert_with_an_mlm_head_is_refused(tmp_path):
    """BertForMaskedLM's cls.predictions.transform reads hidden_act too: 'linear' would change the head."""
    model = tiny_models.tiny_bert()
    _linearise(model, {"encoder": 6})
    _collapse(model, ["encoder"])
    with pytest.raises(LayerCollapseExportError, match=r"cls\.predictions\.transform.*model\.bert"):
        save_layer_collapse(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
