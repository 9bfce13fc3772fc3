"""Baichuan-2 adapter: views over the fused W_pack, the LLaMA-family invariants, the LLaMA export, 13B refusal.

The model is `tiny_baichuan`, our re-implementation of the remote modelling code (the real one cannot be fetched in
tests). The shared conformance base assumes stock transformers classes (position_embeddings kwargs,
AutoModelForCausalLM.from_config), so the same checks are written here against Baichuan's call conventions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import tiny_baichuan
import tiny_models
from common import assert_close, greedy_generate_both_ways, logits, sample_ids, shallower_reference
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.adapters.baichuan import BaichuanAdapter, PackedLinearView
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner
from optimum_flatten.methods.flattengpt import fold_block_norms_
from optimum_flatten.utils.errors import UnsupportedArchitectureError


@pytest.fixture
def model():
    return tiny_models.FACTORIES["baichuan"]()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _naive_parallel(members, hidden, kwargs):
    """Members run in parallel on one input: attention outputs summed, then MLP outputs summed."""
    attn_kwargs = {k: kwargs[k] for k in ("attention_mask", "position_ids")}
    attn = sum(m.self_attn(hidden_states=m.input_layernorm(hidden), **attn_kwargs)[0] for m in members)
    mid = hidden + attn
    return mid + sum(m.mlp(m.post_attention_layernorm(mid)) for m in members)


def _compress(model, method: str):
    config = FlattenConfig(
        method=method, num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24
    )
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    return quantizer


# ------------------------------------------------------------------------------------------------------ views
def test_views_match_config_and_hide_w_pack(model):
    adapter = get_adapter(model)
    config = model.config
    assert isinstance(adapter, BaichuanAdapter)
    assert adapter.stacks() == ["decoder"]
    assert adapter.num_layers() == config.num_hidden_layers
    assert adapter.embeddings() is model.model.embed_tokens
    assert adapter.lm_head() is model.lm_head
    assert adapter.final_norm() is model.model.norm
    hidden = config.hidden_size
    for block, layer in zip(adapter.blocks(), model.model.layers, strict=True):
        att = block.attention
        g = att.geometry
        assert (g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size) == (4, 4, 8, hidden)
        assert att.position_scheme == "rope" and block.norm_position == "pre"
        assert all(isinstance(v, PackedLinearView) for v in (att.q, att.k, att.v))
        w_pack = layer.self_attn.W_pack.weight
        for part, view in enumerate((att.q, att.k, att.v)):
            assert view.weight.shape == (hidden, hidden)
            assert torch.equal(view.weight, w_pack[part * hidden : (part + 1) * hidden])
            assert view.bias is None
        assert att.o.weight.shape == (g.hidden_size, g.num_heads * g.head_dim)
        assert block.mlp.intermediate_size == config.intermediate_size
        assert block.mlp.gate is not None


def test_packed_view_writes_back_into_w_pack(model):
    adapter = get_adapter(model)
    block = adapter.block("decoder", 0)
    hidden = model.config.hidden_size
    before = model.model.layers[0].self_attn.W_pack.weight.detach().clone()
    new_k = torch.randn(hidden, hidden)
    block.attention.k.set_(new_k)
    after = model.model.layers[0].self_attn.W_pack.weight
    assert torch.equal(after[hidden : 2 * hidden], new_k)
    assert torch.equal(after[:hidden], before[:hidden]) and torch.equal(after[2 * hidden :], before[2 * hidden :])
    # A resize goes part by part: the views keep finding their rows while the parts are unequal.
    q, k, v = (block.attention.q.weight[:8].clone(), new_k[:8].clone(), block.attention.v.weight[:8].clone())
    block.attention.q.set_(q)
    assert block.attention.q.out_features == 8 and torch.equal(block.attention.k.weight, new_k)
    block.attention.k.set_(k)
    block.attention.v.set_(v)
    fused = model.model.layers[0].self_attn.W_pack
    assert fused.weight.shape == (24, hidden)
    assert torch.equal(fused.weight, torch.cat([q, k, v]))
    assert not hasattr(fused, "_optimum_flatten_packed_sizes")


# -------------------------------------------------------------------------------------------- invariants
def test_norm_folding_preserves_logits(model):
    ids = sample_ids()
    before = logits(model, ids)
    adapter = get_adapter(model)
    for block in adapter.blocks():
        assert not block.attn_norm.is_unit()
        fold_block_norms_(block)
        assert block.attn_norm.is_unit() and block.mlp_norm.is_unit()
    assert_close(logits(model, ids), before)


def test_concat_equals_members_in_parallel(model):
    adapter = get_adapter(model)
    ids = sample_ids()
    runner = LayerwiseRunner(adapter, [CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))])
    # The remote loop indexes each layer's output; the recorders must still see whole (batch, seq, hidden) states.
    assert runner.inputs[0].shape == (*ids.shape, model.config.hidden_size)
    hidden = runner.run(adapter.layers()[0], 0)[0]
    kwargs = runner.layer_kwargs[1][0]
    assert set(kwargs) >= {"attention_mask", "position_ids", "past_key_value", "use_cache"}
    originals = [copy.deepcopy(adapter.layers()[i]) for i in (1, 2)]
    with torch.no_grad():
        expected = _naive_parallel(originals, hidden, kwargs)
        members = [adapter.detached_block("decoder", i) for i in (1, 2)]
        for member in members:
            fold_block_norms_(member)
        wide = adapter.build_concat_block(members)
        view = adapter.block_view(wide, 1)
        assert view.attention.geometry.num_heads == view.attention.geometry.num_kv_heads == 8
        assert view.mlp.intermediate_size == 2 * model.config.intermediate_size
        # The remote attention splits and reshapes with these attributes at run time.
        assert (wide.self_attn.num_heads, wide.self_attn.hidden_size) == (8, 64)
        assert wide.self_attn.W_pack.weight.shape == (3 * 64, 32)
        actual = runner.run(wide, 1, [hidden])[0]
    assert_close(actual, expected)


def test_keep_heads_equals_zeroed_o_proj_columns(model):
    adapter = get_adapter(model)
    kept = [1, 3]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        o = get_adapter(reference).block("decoder", 1).attention.o.module.weight
        for head in (0, 2):
            o[:, head * 8 : (head + 1) * 8] = 0
    adapter.keep_heads_(adapter.block("decoder", 1), kept)
    pruned = adapter.block("decoder", 1).attention.geometry
    assert (pruned.num_heads, pruned.num_kv_heads) == (2, 2)
    attn = model.model.layers[1].self_attn
    assert (attn.num_heads, attn.hidden_size, tuple(attn.W_pack.weight.shape)) == (2, 16, (48, 32))
    ids = sample_ids()
    assert_close(logits(model, ids), logits(reference, ids))


def test_keep_mlp_channels_equals_zeroed_down_proj_columns(model):
    adapter = get_adapter(model)
    kept = [0, 3, 4, 10, 20, 47]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        down = get_adapter(reference).block("decoder", 3).mlp.down.module.weight
        mask = torch.ones(down.shape[1], dtype=torch.bool)
        mask[kept] = False
        down[:, mask] = 0
    adapter.keep_mlp_channels_(adapter.block("decoder", 3), kept)
    assert adapter.block("decoder", 3).mlp.intermediate_size == len(kept)
    ids = sample_ids()
    assert_close(logits(model, ids), logits(reference, ids))


def test_keep_all_heads_and_channels_and_empty_plan_change_nothing(model):
    adapter = get_adapter(model)
    ids = sample_ids()
    before = logits(model, ids)
    block = adapter.block("decoder", 2)
    adapter.keep_heads_(block, list(range(block.attention.geometry.num_kv_heads)))
    adapter.keep_mlp_channels_(block, list(range(block.mlp.intermediate_size)))
    adapter.keep_layers_("decoder", list(range(adapter.num_layers())))
    adapter.reindex_("decoder")
    adapter.update_config_("decoder", list(range(adapter.num_layers())))
    adapter.validate()
    assert torch.equal(logits(model, ids), before)


def test_dropping_layers_matches_a_fresh_shallower_model_and_keeps_the_cache_right(model):
    kept = [0, 2, 3, 5]
    reference = shallower_reference(model, kept)
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", kept)
    adapter.reindex_("decoder")
    adapter.update_config_("decoder", kept)
    assert model.config.num_hidden_layers == len(kept)
    adapter.validate()  # includes the cached (tuple KV cache) vs uncached forward check
    ids = sample_ids()
    assert_close(logits(model, ids), logits(reference, ids))


def test_validate_detects_inconsistent_config(model):
    adapter = get_adapter(model)
    adapter.keep_layers_("decoder", [0, 1, 2])
    with pytest.raises(ValueError, match="num_hidden_layers"):
        adapter.validate()


def test_validate_detects_a_half_done_resize(model):
    adapter = get_adapter(model)
    block = adapter.block("decoder", 0)
    block.attention.q.set_(block.attention.q.weight[:8])
    with pytest.raises(ValueError, match="unequal q/k/v parts"):
        adapter.validate()


# ------------------------------------------------------------------------------------------------- export
def test_export_model_is_an_equivalent_llama(model):
    ids = sample_ids()
    # Exported before any eval forward, so the head weight is still unnormalised and the bake is really tested.
    exported = get_adapter(model).export_model()
    assert type(exported) is LlamaForCausalLM
    config = exported.config
    assert config.tie_word_embeddings is False
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.max_position_embeddings == model.config.max_position_embeddings
    assert config.rms_norm_eps == model.config.rms_norm_eps
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 4, 8)
    assert not torch.allclose(model.lm_head.weight.norm(dim=-1), torch.ones(tiny_models.VOCAB))
    assert_close(exported.lm_head.weight, F.normalize(model.lm_head.weight.detach()))
    assert exported.lm_head.weight.data_ptr() != exported.model.embed_tokens.weight.data_ptr()
    hidden = model.config.hidden_size
    w_pack = model.model.layers[2].self_attn.W_pack.weight
    assert torch.equal(exported.model.layers[2].self_attn.v_proj.weight, w_pack[2 * hidden :])
    assert_close(logits(exported.eval(), ids), logits(model, ids))
    with_cache, without_cache = greedy_generate_both_ways(exported, ids[:1, :5])
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("method", ["flattengpt", "shortgpt"])
def test_compress_save_reload_as_plain_llama(tmp_path, model, method):
    ids = sample_ids()
    original = logits(model, ids)
    quantizer = _compress(model, method)
    assert model.config.num_hidden_layers == len(model.model.layers) == 4
    compressed = logits(model, ids)
    assert not torch.allclose(compressed, original, atol=1e-3)  # the plan really changed the model
    out = quantizer.save(model, tmp_path / "compressed")
    saved = (out / "config.json").read_text()
    assert '"model_type": "llama"' in saved and "auto_map" not in saved and "quantization_config" not in saved
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is LlamaForCausalLM
    assert reloaded.config.num_hidden_layers == 4
    assert_close(logits(reloaded, ids), compressed)
    with_cache, without_cache = greedy_generate_both_ways(reloaded, ids[:1, :5])
    assert torch.equal(with_cache, without_cache)


# ------------------------------------------------------------------------------------------------ refusals
def test_13b_alibi_is_refused_before_anything_is_touched():
    model = tiny_baichuan.tiny_baichuan_13b()
    assert not hasattr(model.config, "max_position_embeddings")
    ids = sample_ids()
    before_logits = logits(model, ids)
    before_state = _state(model)
    with pytest.raises(UnsupportedArchitectureError, match=r"ALiBi.*RMSNorm and a SwiGLU MLP supports ALiBi"):
        get_adapter(model)
    with pytest.raises(UnsupportedArchitectureError, match="ALiBi"):
        _compress(model, "flattengpt")
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())
    assert model.config.num_hidden_layers == len(model.model.layers) == 4
    assert torch.equal(logits(model, ids), before_logits)


def test_other_baichuan_architectures_are_refused(model):
    model.config.architectures = ["BaiChuanForCausalLM"]  # Baichuan-1 7B's remote class
    with pytest.raises(UnsupportedArchitectureError, match=r"BaichuanForCausalLM.*got architectures"):
        get_adapter(model)
