"""BERT adapter: post-LN views, the shared conformance checks, merges, refusals and the layer-drop methods end to end.

Naive references are written here from copies of the original weights: a freshly built shallower BERT (kept or
merged layers copied by state-dict name), Block Influence recomputed from ``output_hidden_states``, and parameter
merges computed by hand. The compressed models reload through plain ``AutoModelForMaskedLM.from_pretrained``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import AutoModelForMaskedLM, BertForMaskedLM, BertForSequenceClassification, BertModel

import tiny_models
from common import assert_close, compress, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.adapters.bert import BertAdapter
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner, build_calibration_batches
from optimum_flatten.config import CalibrationConfig
from optimum_flatten.ops import MERGE_RULES
from optimum_flatten.registry import require_capabilities
from optimum_flatten.utils.errors import UnsupportedArchitectureError
from tests.adapters.test_conformance import AdapterConformance

HIDDEN, HEADS, HEAD_DIM, INNER, LAYERS = 32, 4, 8, 48, 6
#: The parameters a merge combines, spelled out independently of the adapter (LayerNorms excluded).
MERGED_PARAMETERS = [
    f"{module}.{p}"
    for module in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    )
    for p in ("weight", "bias")
]


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def model():
    return tiny_models.tiny_bert()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh_bert_from_groups(model, groups, rule: str = "differences") -> BertForMaskedLM:
    """A freshly built BertForMaskedLM whose layer p holds `groups[p]` of the original layers, computed by hand.

    A group of one is a copy of that layer; a larger group merges the attention and MLP linears by `rule` and keeps
    the first member's two LayerNorms.
    """
    original = _state(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(groups)
    fresh = BertForMaskedLM(config).to(torch.float32).eval()
    state = {k: v for k, v in original.items() if not k.startswith("bert.encoder.layer.")}
    for new, group in enumerate(groups):
        members = [
            {
                k[len(f"bert.encoder.layer.{old}.") :]: v
                for k, v in original.items()
                if k.startswith(f"bert.encoder.layer.{old}.")
            }
            for old in group
        ]
        merged = dict(members[0])
        if len(members) > 1:
            for name in MERGED_PARAMETERS:
                if rule == "differences":
                    merged[name] = members[0][name] + sum(m[name] - members[0][name] for m in members[1:])
                else:
                    merged[name] = members[-1][name]
        state.update({f"bert.encoder.layer.{new}.{k}": v for k, v in merged.items()})
    fresh.load_state_dict(state)
    return fresh


def _padded_inputs():
    ids = sample_ids(batch=3, length=12)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return ids, mask


@torch.no_grad()
def _masked_logits(model, ids, mask) -> torch.Tensor:
    """MLM logits on the real tokens only (padded positions carry no meaning)."""
    return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


def _check_reload(model, out) -> None:
    """`out` holds `model` saved as a plain BERT: it reloads (eager and SDPA) with equal MLM logits."""
    ids, mask = _padded_inputs()
    saved = (out / "config.json").read_text()
    assert '"model_type": "bert"' in saved and "quantization_config" not in saved
    for implementation in ("eager", "sdpa"):
        reloaded = AutoModelForMaskedLM.from_pretrained(out, dtype=torch.float32, attn_implementation=implementation)
        reloaded.eval()
        assert type(reloaded) is BertForMaskedLM
        assert reloaded.config.num_hidden_layers == len(reloaded.bert.encoder.layer) == model.config.num_hidden_layers
        assert_close(_masked_logits(reloaded, ids, mask), _masked_logits(model, ids, mask))


# ------------------------------------------------------------------------------------ shared conformance
class TestBertConformance(AdapterConformance):
    """The shared checks on the encoder stack; post-LN, so folding and concatenation must be refused."""

    factory = "bert"
    stack = "encoder"
    norm_position = "post"
    generates = False
    concat_supported = False
    concat_refusal = "post-LN"

    def expected_num_kv_heads(self, config) -> int:
        return config.num_attention_heads

    def shallower_reference(self, model, kept):
        return fresh_bert_from_groups(model, [(i,) for i in kept])


# ------------------------------------------------------------------------------------------------- views
def test_views_bind_bert_modules(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, BertAdapter)
    assert adapter.stacks() == ["encoder"] and adapter.num_layers() == LAYERS
    assert adapter.base_model() is model.bert
    assert adapter.embeddings() is model.bert.embeddings.word_embeddings
    assert adapter.position_embeddings() is model.bert.embeddings.position_embeddings
    assert adapter.final_norm() is None and adapter.lm_head() is None
    for block, layer in zip(adapter.blocks(), model.bert.encoder.layer, strict=True):
        att, mlp = block.attention, block.mlp
        assert block.norm_position == "post" and block.cross_attention is None
        assert block.attn_norm.module is layer.attention.output.LayerNorm
        assert block.mlp_norm.module is layer.output.LayerNorm
        assert (att.geometry.num_heads, att.geometry.num_kv_heads, att.geometry.head_dim) == (HEADS, HEADS, HEAD_DIM)
        assert att.position_scheme == "learned"
        assert att.q.module is layer.attention.self.query and att.k.module is layer.attention.self.key
        assert att.v.module is layer.attention.self.value and att.o.module is layer.attention.output.dense
        assert mlp.gate is None and mlp.up.module is layer.intermediate.dense and mlp.down.module is layer.output.dense
        assert mlp.activation is layer.intermediate.intermediate_act_fn and mlp.intermediate_size == INNER


def test_view_round_trip_is_the_identity(model):
    adapter = get_adapter(model)
    ids, mask = _padded_inputs()
    before_state, before = _state(model), _masked_logits(model, ids, mask)
    for block in adapter.blocks():
        for view in (block.attention.q, block.attention.k, block.attention.v, block.attention.o):
            view.set_(view.weight.clone(), view.bias.clone())
        for view in (block.mlp.up, block.mlp.down):
            view.set_(view.weight.clone(), view.bias.clone())
    after = model.state_dict()
    assert after.keys() == before_state.keys()
    assert all(torch.equal(after[k], v) for k, v in before_state.items())
    assert torch.equal(_masked_logits(model, ids, mask), before)


@pytest.mark.parametrize("cls", [BertModel, BertForSequenceClassification])
def test_other_bert_classes_bind_the_same_encoder(cls):
    torch.manual_seed(0)
    other = cls(tiny_models.tiny_bert().config).eval()
    adapter = get_adapter(other)
    base = other if cls is BertModel else other.bert
    assert adapter.base_model() is base and adapter.layers() is base.encoder.layer
    assert adapter.lm_head() is None and adapter.final_norm() is None
    adapter.keep_layers_("encoder", [0, 2, 5])
    adapter.reindex_("encoder")
    adapter.update_config_("encoder", [0, 2, 5])
    adapter.validate()


def test_decoder_bert_is_refused():
    with pytest.raises(UnsupportedArchitectureError, match="is_decoder=True"):
        get_adapter(tiny_models.tiny_bert(is_decoder=True))


def test_unknown_stack_is_refused(model):
    with pytest.raises(ValueError, match=r"stacks \['encoder'\], got 'decoder'"):
        get_adapter(model).layers("decoder")


def test_capabilities_are_honest(model):
    adapter = get_adapter(model)
    assert {"head_geometry", "layer_drop"} <= adapter.capabilities
    assert not {"pre_norm", "concat_heads", "gated_mlp"} & adapter.capabilities
    with pytest.raises(UnsupportedArchitectureError, match=r"post-LN.*shortgpt, laco or sliding_window"):
        require_capabilities(adapter, "flattengpt")


def test_head_pruning_syncs_the_informational_sizes(model):
    adapter = get_adapter(model)
    adapter.keep_heads_(adapter.block("encoder", 2), [0, 3])
    attention = model.bert.encoder.layer[2].attention.self
    assert (attention.num_attention_heads, attention.all_head_size) == (2, 2 * HEAD_DIM)
    with pytest.raises(ValueError, match="layer 2 has 2 heads of 8"):
        adapter.validate()  # the config still says 4 heads per layer


# ---------------------------------------------------------------------------------------------- calibration
def test_calibration_records_positional_arguments_and_padding(model):
    """BertEncoder passes the mask positionally; the runner replays it and the token mask is the text mask."""
    ids, mask = _padded_inputs()
    batch = CalibrationBatch(input_ids=ids, attention_mask=mask)
    adapter = get_adapter(model)
    runner = LayerwiseRunner(adapter, [batch], "encoder")
    assert torch.equal(runner.masks[0], mask)
    assert runner.layer_kwargs[1][0]["attention_mask"] is not None
    with torch.no_grad():
        expected = model.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    current = runner.inputs
    for i, layer in enumerate(model.bert.encoder.layer):
        assert_close(current[0][mask.bool()], expected[i][mask.bool()])
        current = runner.run(layer, i, current)
    assert_close(current[0][mask.bool()], expected[-1][mask.bool()])


# ---------------------------------------------------------------------------------------------- merges
def test_mergeable_state_leaves_the_layernorms_out(model):
    state = get_adapter(model).mergeable_state(model.bert.encoder.layer[2])
    assert sorted(state) == sorted(MERGED_PARAMETERS)


@pytest.mark.parametrize("rule", ["differences", "reference_code"])
def test_parameter_merge_equals_naive_merge_in_a_fresh_model(model, rule):
    groups = [(0,), (1, 2, 3), (4,), (5,)]
    reference = fresh_bert_from_groups(model, groups, rule)
    adapter = get_adapter(model)
    layers = adapter.layers()
    state = MERGE_RULES[rule]([adapter.mergeable_state(layers[i]) for i in groups[1]])
    adapter.replace_block_("encoder", 1, adapter.build_merged_block("encoder", 1, state))
    adapter.keep_layers_("encoder", [0, 1, 4, 5])
    adapter.reindex_("encoder")
    adapter.update_config_("encoder", [0, 1, 4, 5])
    adapter.validate()
    ids, mask = _padded_inputs()
    assert_close(_masked_logits(model, ids, mask), _masked_logits(reference, ids, mask))


# ------------------------------------------------------------------------------------- methods end to end
@pytest.mark.parametrize(
    ("method", "method_args"),
    [("shortgpt", {}), ("laco", {"threshold": None}), ("sliding_window", {"threshold": None})],
)
def test_method_compresses_and_reloads_as_plain_bert(tmp_path, model, method, method_args):
    ids, mask = _padded_inputs()
    original_model = copy.deepcopy(model)
    original = _masked_logits(model, ids, mask)
    quantizer = compress(model, method, num_layers_to_remove=2, **method_args)
    assert model.config.num_hidden_layers == len(model.bert.encoder.layer) == LAYERS - 2
    assert [layer.attention.self.layer_idx for layer in model.bert.encoder.layer] == list(range(LAYERS - 2))
    assert not torch.allclose(_masked_logits(model, ids, mask), original, atol=1e-3)
    rule = getattr(quantizer.config.method_config, "merge_rule", "differences")
    reference = fresh_bert_from_groups(original_model, [tuple(g) for g in quantizer.plan.group_lists()], rule)
    assert_close(_masked_logits(model, ids, mask), _masked_logits(reference, ids, mask))
    _check_reload(model, quantizer.save(model, tmp_path / "compressed"))


def test_shortgpt_keeps_the_layers_a_naive_block_influence_ranks_highest():
    """BI_i = 1 - mean cos(h_i, h_i+1) over real tokens, where h_i are BERT's post-LN layer outputs."""
    model = tiny_models.tiny_bert()
    calibration = CalibrationConfig(dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), calibration)
    sums = torch.zeros(LAYERS, dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for batch in batches:
            states = model.bert(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
            real = batch.attention_mask.bool()
            for i in range(LAYERS):
                a, b = states.hidden_states[i][real].double(), states.hidden_states[i + 1][real].double()
                sums[i] += torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()
            count += int(real.sum())
    influence = 1.0 - sums / count
    expected_kept = sorted(torch.argsort(influence, descending=True)[: LAYERS - 2].tolist())
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    assert quantizer.plan.first_indices == expected_kept
    torch.testing.assert_close(
        torch.tensor(quantizer.report["block_influence"], dtype=torch.float64), influence, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("method", "match"),
    [
        ("flattengpt", r"post-LN.*shortgpt, laco or sliding_window"),
        ("sleb", r"causal LM head.*lm_head\(\) is None.*shortgpt, laco, sliding_window"),
    ],
)
def test_refused_methods_leave_the_model_untouched(model, method, match):
    before = _state(model)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        compress(model, method, num_layers_to_remove=2)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert model.config.num_hidden_layers == len(model.bert.encoder.layer) == LAYERS


def test_a_refusal_offers_only_methods_that_run_on_bert():
    """FlattenGPT's refusal offered auto, greedy_replace, replaceme and sleb, each refused in turn (and replaceme's
    refusal offered sleb again): the alternatives are now those whose own preflight passes."""
    model = tiny_models.tiny_bert()
    with pytest.raises(UnsupportedArchitectureError, match=r"Methods that run on this BertForMaskedLM") as refused:
        compress(model, "flattengpt", num_layers_to_remove=2)
    offered = re.search(r"run on this BertForMaskedLM: (\[.*?\])", str(refused.value)).group(1)
    assert "'shortgpt'" in offered and not {"'sleb'", "'replaceme'", "'auto'", "'greedy_replace'"} & set(
        offered.strip("[]").split(", ")
    )
    with pytest.raises(UnsupportedArchitectureError) as refused:
        compress(model, "replaceme", num_layers_to_remove=2)
    assert "(laco, shortgpt, sliding_window, uidl)" in str(refused.value)
