"""Baichuan-2 adapter: the shared conformance checks, plus its quirks: views over the fused W_pack that write back
into it, the remote attention's size attributes, the export as an equivalent LLaMA, the 13B (ALiBi) refusal.

The model is `tiny_baichuan`, our re-implementation of the remote modelling code (the real one cannot be fetched in
tests). Its layers take ``position_ids`` (not transformers' ``position_embeddings``) and the remote class has no
``generate``, so the conformance subclass gives its own naive parallel form and leaves generation out (``validate``
compares a cached forward with an uncached one instead).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import tiny_baichuan
import tiny_models
from common import assert_close, compress, greedy_generate_both_ways, logits, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.adapters.baichuan import BaichuanAdapter, PackedLinearView
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner
from optimum_flatten.methods.flattengpt import fold_block_norms_
from optimum_flatten.utils.errors import UnsupportedArchitectureError
from tests.adapters.test_conformance import AdapterConformance


@pytest.fixture
def model():
    return tiny_models.FACTORIES["baichuan"]()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ shared conformance
class TestBaichuanConformance(AdapterConformance):
    """The shared checks on the decoder stack, with Baichuan's call convention and two non-adjacent kept heads."""

    factory = "baichuan"
    generates = False  # the remote class has no generate(); validate() checks the cached forward itself
    half_resize_refusal = "unequal q/k/v parts"

    def expected_num_kv_heads(self, config) -> int:
        return config.num_attention_heads  # no GQA: W_pack holds as many k and v heads as q heads

    def kept_kv_heads(self, geometry) -> list[int]:
        return [1, 3]

    def naive_parallel(self, members, hidden, kwargs):
        """Members run in parallel on one input (the remote attention takes position_ids): attention outputs
        summed, then MLP outputs summed."""
        attn_kwargs = {k: kwargs[k] for k in ("attention_mask", "position_ids")}
        attn = sum(m.self_attn(hidden_states=m.input_layernorm(hidden), **attn_kwargs)[0] for m in members)
        mid = hidden + attn
        return mid + sum(m.mlp(m.post_attention_layernorm(mid)) for m in members)


# ------------------------------------------------------------------------------------------------------ views
def test_views_hide_w_pack(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, BaichuanAdapter)
    assert adapter.embeddings() is model.model.embed_tokens
    assert adapter.lm_head() is model.lm_head
    assert adapter.final_norm() is model.model.norm
    hidden = model.config.hidden_size
    for block, layer in zip(adapter.blocks(), model.model.layers, strict=True):
        att = block.attention
        assert (att.geometry.head_dim, att.geometry.hidden_size) == (8, hidden)
        assert att.position_scheme == "rope" and block.mlp.gate is not None
        assert all(isinstance(v, PackedLinearView) for v in (att.q, att.k, att.v))
        w_pack = layer.self_attn.W_pack.weight
        for part, view in enumerate((att.q, att.k, att.v)):
            assert view.weight.shape == (hidden, hidden)
            assert torch.equal(view.weight, w_pack[part * hidden : (part + 1) * hidden])
            assert view.bias is None


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


# ------------------------------------------------------------------------------- the remote attention's sizes
def test_concat_block_sets_the_remote_attributes_and_records_whole_states(model):
    """The remote attention splits and reshapes with num_heads / hidden_size at run time, and the remote layer loop
    indexes each layer's output; the base checks the concatenated block's outputs, this checks what they rely on."""
    adapter = get_adapter(model)
    ids = sample_ids()
    runner = LayerwiseRunner(adapter, [CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))])
    assert runner.inputs[0].shape == (*ids.shape, model.config.hidden_size)
    assert set(runner.layer_kwargs[1][0]) >= {"attention_mask", "position_ids", "past_key_value", "use_cache"}
    members = [adapter.detached_block("decoder", i) for i in (1, 2)]
    for member in members:
        fold_block_norms_(member)
    wide = adapter.build_concat_block(members)
    assert (wide.self_attn.num_heads, wide.self_attn.hidden_size) == (8, 64)
    assert wide.self_attn.W_pack.weight.shape == (3 * 64, 32)


def test_head_pruning_resizes_w_pack_and_the_remote_attributes(model):
    adapter = get_adapter(model)
    adapter.keep_heads_(adapter.block("decoder", 1), [1, 3])
    attn = model.model.layers[1].self_attn
    assert (attn.num_heads, attn.hidden_size, tuple(attn.W_pack.weight.shape)) == (2, 16, (48, 32))


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


@pytest.mark.parametrize("method", ["flattengpt", "shortgpt", "ffn_merge"])
def test_compress_save_reload_as_plain_llama(tmp_path, model, method):
    """ffn_merge keeps the depth and ties MLPs across layers: the export stores each layer's in full (the tie made
    save_pretrained refuse the shared tensors)."""
    ids = sample_ids()
    original = logits(model, ids)
    target = {"window_size": 2, "num_windows": 1} if method == "ffn_merge" else {"num_layers_to_remove": 2}
    quantizer = compress(model, method, **target)
    depth = 6 if method == "ffn_merge" else 4
    assert model.config.num_hidden_layers == len(model.model.layers) == depth
    compressed = logits(model, ids)
    assert not torch.allclose(compressed, original, atol=1e-3)  # the plan really changed the model
    out = quantizer.save(model, tmp_path / "compressed")
    saved = (out / "config.json").read_text()
    assert '"model_type": "llama"' in saved and "auto_map" not in saved and "quantization_config" not in saved
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is LlamaForCausalLM
    assert reloaded.config.num_hidden_layers == depth
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
        compress(model, "flattengpt", num_layers_to_remove=2)
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())
    assert model.config.num_hidden_layers == len(model.model.layers) == 4
    assert torch.equal(logits(model, ids), before_logits)


def test_other_baichuan_architectures_are_refused(model):
    model.config.architectures = ["BaiChuanForCausalLM"]  # Baichuan-1 7B's remote class
    with pytest.raises(UnsupportedArchitectureError, match=r"BaichuanForCausalLM.*got architectures"):
        get_adapter(model)


def test_compress_on_load_refuses_a_family_only_the_quantizers_save_writes_as_a_stock_model():
    """Compress-on-load hands back the loaded remote-code class, whose save_pretrained writes remote code, while
    only `FlattenQuantizer.save` writes the stock LlamaForCausalLM; refused before the compression, weights kept.
    Called at the step from_pretrained calls after the weights load (the tiny remote code is not on disk here)."""
    from common import tiny_config
    from optimum_flatten.integration import FlattenHfQuantizer

    model = tiny_baichuan.tiny_baichuan()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = tiny_config("shortgpt", num_layers_to_remove=2, tokenizer=tiny_models.CharTokenizer())
    with pytest.raises(ValueError, match=r"only by FlattenQuantizer\.save"):
        FlattenHfQuantizer(config)._process_model_after_weight_loading(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not get_adapter(tiny_models.tiny_llama_gqa()).exports_another_model()
