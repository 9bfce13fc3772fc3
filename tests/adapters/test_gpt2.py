"""GPT-2 adapter: Conv1D views, the shared conformance checks, layer-index scaling, merges and every method end to end.

Naive references are written here from copies of the original weights: a hand-run of the original blocks, a
freshly built shallower GPT-2, a parallel run of two blocks, and parameter merges computed by hand.

Calibration: ``GPT2Model.forward`` passes the cache (``cache`` from transformers 5.24), the mask and
``encoder_hidden_states`` to each block *positionally*; the calibration recorder names them through the block's
signature (`test_calibration_records_positional_block_arguments`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import tiny_models
from common import assert_close, compress, greedy_generate_both_ways, logits, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.adapters.gpt2 import Conv1DView, GPT2Adapter, PackedConv1DView
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner
from optimum_flatten.ops import MERGE_RULES
from optimum_flatten.utils.cache import cache_keyword
from optimum_flatten.utils.errors import UnsupportedArchitectureError
from tests.adapters.test_conformance import AdapterConformance

HIDDEN, HEADS, HEAD_DIM, INNER = 32, 4, 8, 48


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(params=["gpt2", "gpt2_layer_scaled"])
def model(request):
    return tiny_models.FACTORIES[request.param]()


def _runner(model, ids=None):
    ids = sample_ids() if ids is None else ids
    batch = CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))
    return LayerwiseRunner(get_adapter(model), [batch])


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _layer_scale(config, index: int) -> float:
    """Naive: the factor a GPT-2 layer at `index` divides its attention scores by (1 when the option is off)."""
    return float(index + 1) if config.scale_attn_by_inverse_layer_idx else 1.0


def _rescale_queries(state: dict[str, torch.Tensor], prefix: str, factor: float) -> None:
    """Naive: multiplies the query columns (the first n_embd outputs of the stored (in, 3n) c_attn) by `factor`."""
    weight, bias = state[prefix + "attn.c_attn.weight"].clone(), state[prefix + "attn.c_attn.bias"].clone()
    weight[:, :HIDDEN] = (weight[:, :HIDDEN].double() * factor).float()
    bias[:HIDDEN] = (bias[:HIDDEN].double() * factor).float()
    state[prefix + "attn.c_attn.weight"], state[prefix + "attn.c_attn.bias"] = weight, bias


def fresh_gpt2_from_groups(model, groups, rule: str = "differences") -> GPT2LMHeadModel:
    """A freshly built GPT-2 whose layer p holds group `groups[p]` of the original layers, computed by hand.

    A group of one is a copy of that layer; a larger group merges attention and MLP parameters by `rule` (norms
    from the first member). Under ``scale_attn_by_inverse_layer_idx`` the queries are first brought to what each
    original layer really applies (divided by its index + 1) and then to the new position (times p + 1), since a
    fresh GPT-2 divides layer p's scores by p + 1.
    """
    original = _state(model)
    config = copy.deepcopy(model.config)
    config.n_layer = len(groups)
    fresh = GPT2LMHeadModel(config).to(torch.float32).eval()
    state = {k: v for k, v in original.items() if not k.startswith("transformer.h.")}
    for new, group in enumerate(groups):
        members = []
        for old in group:
            member = {
                k[len(f"transformer.h.{old}.") :]: v
                for k, v in original.items()
                if k.startswith(f"transformer.h.{old}.")
            }
            _rescale_queries(member, "", 1.0 / _layer_scale(config, old))
            members.append(member)
        merged = dict(members[0])
        for name in merged:
            if name.startswith(("attn.", "mlp.")) and len(members) > 1:
                if rule == "differences":
                    merged[name] = members[0][name] + sum(m[name] - members[0][name] for m in members[1:])
                else:
                    merged[name] = members[-1][name]
        _rescale_queries(merged, "", _layer_scale(config, new))
        state.update({f"transformer.h.{new}.{k}": v for k, v in merged.items()})
    fresh.load_state_dict(state)
    return fresh


@torch.no_grad()
def run_original_blocks(model, kept, ids) -> torch.Tensor:
    """Naive: the logits of embeddings -> the original blocks `kept`, in order, each as it is -> ln_f -> head."""
    base = model.transformer
    positions = torch.arange(ids.shape[1])[None]
    hidden = base.wte(ids) + base.wpe(positions)
    mask = torch.full((ids.shape[1], ids.shape[1]), torch.finfo(hidden.dtype).min).triu(1)[None, None]
    for i in kept:
        block = base.h[i]
        hidden = hidden + block.attn(block.ln_1(hidden), attention_mask=mask)[0]
        hidden = hidden + block.mlp(block.ln_2(hidden))
    return model.lm_head(base.ln_f(hidden))


def _check_reload(model, out, ids) -> None:
    """`out` holds `model` saved as a plain GPT-2: it reloads (eager and SDPA) with equal logits and a sound cache."""
    compressed = logits(model, ids)
    saved = (out / "config.json").read_text()
    assert '"model_type": "gpt2"' in saved and "quantization_config" not in saved
    for implementation in ("eager", "sdpa"):
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=implementation)
        reloaded.eval()
        assert type(reloaded) is GPT2LMHeadModel
        assert reloaded.config.n_layer == len(reloaded.transformer.h) == model.config.n_layer
        assert_close(logits(reloaded, ids), compressed)
    with_cache, without_cache = greedy_generate_both_ways(reloaded, ids[:1, :5])
    assert torch.equal(with_cache, without_cache)


# ------------------------------------------------------------------------------------ shared conformance
class TestGPT2Conformance(AdapterConformance):
    """The shared checks, with GPT-2's config keys, block layout and naive references."""

    factory = "gpt2"
    half_resize_refusal = "unequal q/k/v parts"

    def expected_num_kv_heads(self, config) -> int:
        return config.n_head

    def expected_intermediate_size(self, config) -> int:
        return config.n_inner

    def naive_parallel(self, members, hidden, kwargs):
        """Two GPT-2 blocks on one input: attention outputs summed, then MLP outputs summed."""
        mask = kwargs["attention_mask"]
        attn = sum(m.attn(m.ln_1(hidden), attention_mask=mask)[0] for m in members)
        mid = hidden + attn
        return mid + sum(m.mlp(m.ln_2(mid)) for m in members)

    def shallower_reference(self, model, kept):
        return fresh_gpt2_from_groups(model, [(i,) for i in kept])


class TestGPT2LayerScaledConformance(TestGPT2Conformance):
    """The same checks with scores divided by layer_idx + 1 (and the upcast/reordered attention path)."""

    factory = "gpt2_layer_scaled"


def test_calibration_records_positional_block_arguments():
    model = tiny_models.tiny_gpt2()
    ids = sample_ids()
    runner = _runner(model, ids)
    recorded = runner.layer_kwargs[1][0]
    # The cache goes by the name this transformers release gives it (``cache`` from 5.24, ``past_key_values`` before).
    assert "attention_mask" in recorded and cache_keyword(model.transformer.h[0]) in recorded
    # Running the recorded arguments by keyword reproduces the model's own hidden states.
    expected = model.transformer(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    current = runner.inputs
    for i, layer in enumerate(model.transformer.h):
        assert_close(current[0], expected[i])
        current = runner.run(layer, i, current)


# ------------------------------------------------------------------------------------------------- views
def test_views_show_conv1d_weights_as_out_in(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, GPT2Adapter)
    assert adapter.stacks() == ["decoder"] and adapter.num_layers() == model.config.n_layer
    assert adapter.embeddings() is model.transformer.wte
    assert adapter.position_embeddings() is model.transformer.wpe
    assert adapter.final_norm() is model.transformer.ln_f
    assert adapter.lm_head() is model.lm_head
    for block, layer in zip(adapter.blocks(), model.transformer.h, strict=True):
        att, mlp = block.attention, block.mlp
        assert (att.geometry.num_heads, att.geometry.num_kv_heads, att.geometry.head_dim) == (HEADS, HEADS, HEAD_DIM)
        assert att.geometry.hidden_size == HIDDEN
        assert att.position_scheme == "learned" and block.norm_position == "pre" and block.cross_attention is None
        assert block.attn_norm.module is layer.ln_1 and block.mlp_norm.module is layer.ln_2
        assert block.attn_norm.kind == block.mlp_norm.kind == "layer" and block.attn_norm.bias is not None
        assert all(isinstance(v, PackedConv1DView) for v in (att.q, att.k, att.v))
        c_attn = layer.attn.c_attn.weight
        assert c_attn.shape == (HIDDEN, 3 * HIDDEN)  # Conv1D stores (in, out)
        for part, view in enumerate((att.q, att.k, att.v)):
            columns = slice(part * HIDDEN, (part + 1) * HIDDEN)
            assert torch.equal(view.weight, c_attn[:, columns].T)
            assert torch.equal(view.bias, layer.attn.c_attn.bias[columns])
        assert isinstance(att.o, Conv1DView) and torch.equal(att.o.weight, layer.attn.c_proj.weight.T)
        assert att.o.weight.shape == (HIDDEN, HEADS * HEAD_DIM)
        assert mlp.gate is None and mlp.activation is layer.mlp.act
        assert mlp.up.weight.shape == (INNER, HIDDEN) and torch.equal(mlp.up.weight, layer.mlp.c_fc.weight.T)
        assert mlp.down.weight.shape == (HIDDEN, INNER) and torch.equal(mlp.down.weight, layer.mlp.c_proj.weight.T)
        assert mlp.intermediate_size == INNER


def test_view_round_trip_is_the_identity(model):
    adapter = get_adapter(model)
    ids = sample_ids()
    before_state, before_logits = _state(model), logits(model, ids)
    for block in adapter.blocks():
        att, mlp = block.attention, block.mlp
        for view in (att.q, att.k, att.v, att.o, mlp.up, mlp.down):
            view.set_(view.weight.clone(), view.bias.clone())
    after = model.state_dict()
    assert after.keys() == before_state.keys()
    assert all(torch.equal(after[k], v) for k, v in before_state.items())
    assert all(type(m) is Conv1D for name, m in model.named_modules() if name.endswith(("c_attn", "c_proj", "c_fc")))
    assert torch.equal(logits(model, ids), before_logits)


def test_in_place_edits_through_a_view_reach_the_parameter(model):
    block = get_adapter(model).block("decoder", 0)
    with torch.no_grad():
        block.attention.o.weight[:, 3] = 0.0
        block.attention.k.weight[5] = 1.0
    assert torch.all(model.transformer.h[0].attn.c_proj.weight[3] == 0)
    assert torch.all(model.transformer.h[0].attn.c_attn.weight[:, HIDDEN + 5] == 1)


def test_packed_view_writes_one_part_and_resizes_part_by_part(model):
    block = get_adapter(model).block("decoder", 0)
    att = block.attention
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    new_k, new_bias = torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN)
    att.k.set_(new_k, new_bias)
    fused = model.transformer.h[0].attn.c_attn
    assert type(fused) is Conv1D and (fused.nx, fused.nf) == (HIDDEN, 3 * HIDDEN)
    assert torch.equal(fused.weight[:, HIDDEN : 2 * HIDDEN], new_k.T) and torch.equal(att.k.bias, new_bias)
    assert torch.equal(fused.weight[:, :HIDDEN], before[:, :HIDDEN])
    assert torch.equal(fused.weight[:, 2 * HIDDEN :], before[:, 2 * HIDDEN :])
    q, k, v = (view.weight[:8].clone() for view in (att.q, att.k, att.v))
    att.q.set_(q)
    assert att.q.out_features == 8 and torch.equal(att.k.weight, new_k)  # views still find their columns
    att.k.set_(k)
    att.v.set_(v)
    fused = model.transformer.h[0].attn.c_attn
    assert fused.weight.shape == (HIDDEN, 24) and fused.nf == 24
    assert torch.equal(fused.weight, torch.cat([q, k, v]).T)
    assert not hasattr(fused, "_optimum_flatten_packed_sizes")


def test_capabilities_are_honest(model):
    adapter = get_adapter(model)
    assert "gated_mlp" not in adapter.capabilities
    assert {"head_geometry", "pre_norm", "concat_heads", "layer_drop"} <= adapter.capabilities
    assert "without a gate projection" in adapter.missing_capabilities({"gated_mlp", "layer_drop"})["gated_mlp"]
    assert set(adapter.missing_capabilities({"gated_mlp", "layer_drop"})) == {"gated_mlp"}


def test_cross_attention_gpt2_is_refused():
    model = tiny_models.tiny_gpt2(add_cross_attention=True)
    with pytest.raises(UnsupportedArchitectureError, match="add_cross_attention=True"):
        get_adapter(model)


# ------------------------------------------------------------------------------- layer-index scaling
def test_reindex_compensates_layer_index_scaling_exactly(tmp_path):
    model = tiny_models.tiny_gpt2_layer_scaled()
    kept = [0, 3, 5]
    ids = sample_ids()
    expected = run_original_blocks(model, kept, ids)
    # Negative control: the kept weights copied unchanged into a fresh GPT-2 (renumbering without compensation).
    uncompensated = fresh_gpt2_from_groups(model, [(i,) for i in kept])
    state = _state(model)
    for new, old in enumerate(kept):
        for name in ("weight", "bias"):
            key = f"attn.c_attn.{name}"
            uncompensated.state_dict()[f"transformer.h.{new}.{key}"].copy_(state[f"transformer.h.{old}.{key}"])
    assert not torch.allclose(logits(uncompensated, ids), expected, atol=1e-3)
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", kept)
    adapter.reindex_("decoder")
    adapter.update_config_("decoder", kept)
    adapter.validate()
    assert [layer.attn.layer_idx for layer in model.transformer.h] == [0, 1, 2]
    assert [layer.attn.scaling for layer in model.transformer.h] == [HEAD_DIM**-0.5 / i for i in (1, 2, 3)]
    assert_close(logits(model, ids), expected)
    model.save_pretrained(tmp_path / "compressed")
    _check_reload(model, tmp_path / "compressed", ids)


def test_reindex_without_the_option_leaves_weights_untouched():
    model = tiny_models.tiny_gpt2()
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", [1, 4])
    moved = model.transformer.h[1].attn.c_attn
    adapter.reindex_("decoder")
    assert model.transformer.h[1].attn.c_attn is moved  # scaling does not depend on the index: nothing rebuilt


def test_validate_detects_an_uncompensated_renumbering():
    model = tiny_models.tiny_gpt2_layer_scaled()
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", [0, 2])
    adapter.update_config_("decoder", [0, 2])
    model.transformer.h[1].attn.layer_idx = 1  # renumbered by hand, scaling left at layer 2's
    with pytest.raises(ValueError, match=r"layer 1 attention scaling .* what it gets on reload"):
        adapter.validate()


# ---------------------------------------------------------------------------------------------- merges
def test_mergeable_state_covers_attention_and_mlp_only(model):
    adapter = get_adapter(model)
    state = adapter.mergeable_state(model.transformer.h[2])
    assert set(state) == {
        f"{m}.{p}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj") for p in ("weight", "bias")
    }


@pytest.mark.parametrize("rule", ["differences", "reference_code"])
def test_parameter_merge_equals_naive_merge_in_a_fresh_model(model, rule):
    groups = [(0,), (1, 2, 3), (4,), (5,)]
    reference = fresh_gpt2_from_groups(model, groups, rule)
    adapter = get_adapter(model)
    layers = adapter.layers()
    merged = adapter.build_merged_block(
        "decoder", 1, MERGE_RULES[rule]([adapter.mergeable_state(layers[i]) for i in groups[1]])
    )
    adapter.replace_block_("decoder", 1, merged)
    adapter.keep_layers_("decoder", [0, 1, 4, 5])
    adapter.reindex_("decoder")
    adapter.update_config_("decoder", [0, 1, 4, 5])
    adapter.validate()
    ids = sample_ids()
    assert_close(logits(model, ids), logits(reference, ids))


def test_merging_one_layer_is_the_identity(model):
    adapter = get_adapter(model)
    ids = sample_ids()
    before = logits(model, ids)
    block = adapter.build_merged_block("decoder", 3, adapter.mergeable_state(adapter.layers()[3]))
    adapter.replace_block_("decoder", 3, block)
    assert_close(logits(model, ids), before)


# ------------------------------------------------------------------------------------- methods end to end
@pytest.mark.parametrize(
    ("method", "method_args"),
    [("shortgpt", {}), ("sleb", {}), ("laco", {"threshold": None}), ("sliding_window", {"threshold": None})],
)
def test_method_compresses_and_reloads_as_plain_gpt2(tmp_path, model, method, method_args):
    ids = sample_ids()
    original_model = copy.deepcopy(model)
    original = logits(model, ids)
    quantizer = compress(model, method, num_layers_to_remove=2, **method_args)
    assert model.config.n_layer == len(model.transformer.h) == 4
    assert not torch.allclose(logits(model, ids), original, atol=1e-3)  # the plan really changed the model
    # The compressed model is the plan applied by hand to a fresh GPT-2.
    reference = fresh_gpt2_from_groups(original_model, [tuple(g) for g in quantizer.plan.group_lists()])
    assert_close(logits(model, ids), logits(reference, ids))
    _check_reload(model, quantizer.save(model, tmp_path / "compressed"), ids)


def test_flattengpt_on_gpt2(tmp_path, model):
    """FlattenGPT's maths never reads a gate: on GPT-2 it folds the LayerNorm biases and prunes the plain MLP."""
    ids = sample_ids()
    original = logits(model, ids)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2)
    assert model.config.n_layer == len(model.transformer.h) == 4
    for block in get_adapter(model).blocks():
        assert block.attention.geometry.num_heads == HEADS and block.mlp.intermediate_size == INNER
    assert not torch.allclose(logits(model, ids), original, atol=1e-3)
    _check_reload(model, quantizer.save(model, tmp_path / "compressed"), ids)
