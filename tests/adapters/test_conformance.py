"""Every adapter passes the same conformance checks (one subclass per tiny-model factory)."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import assert_close, greedy_generate_both_ways, logits, sample_ids, shallower_reference
from optimum_flatten import get_adapter
from optimum_flatten.adapters import registered_adapters
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner
from optimum_flatten.methods.flattengpt import fold_block_norms_
from optimum_flatten.registry import require_capabilities
from optimum_flatten.utils.errors import UnsupportedArchitectureError


def test_every_registered_adapter_has_a_tiny_factory():
    missing = [t for t in registered_adapters() if t not in tiny_models.MODEL_TYPES]
    assert not missing, f"adapters without a tiny-model factory: {missing}"


def _runner(adapter, ids):
    batch = CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))
    return LayerwiseRunner(adapter, [batch])


def _naive_parallel(members, hidden, kwargs):
    """Members run in parallel on one input: attention outputs summed, then MLP outputs summed."""
    attn = sum(m.self_attn(hidden_states=m.input_layernorm(hidden), **_attn_kwargs(kwargs))[0] for m in members)
    mid = hidden + attn
    return mid + sum(m.mlp(m.post_attention_layernorm(mid)) for m in members)


def _attn_kwargs(kwargs):
    names = ("attention_mask", "position_embeddings", "past_key_values", "cache")
    return {k: v for k, v in kwargs.items() if k in names}


class AdapterConformance:
    factory: str
    concat_supported = True
    #: Text the refusal must contain when `concat_supported` is False.
    concat_refusal = "q_norm"
    #: The block stack checked, where its blocks put their norms, and whether the model generates with a KV cache
    #: (encoders such as BERT and ViT use "encoder", and BERT's norms are "post").
    stack = "decoder"
    norm_position = "pre"
    generates = True
    #: The config key that counts the layers of `stack` (Marian's "encoder_layers" / "decoder_layers").
    layer_count_key = "num_hidden_layers"
    #: The layers the layer-dropping check keeps (a family with fewer layers than the tiny LLaMA's six sets its own).
    kept_layers = (0, 2, 3, 5)
    #: What `validate` says when q was resized without k and v (GPT-2 and Baichuan, whose q/k/v share one fused
    #: matrix, say "unequal q/k/v parts").
    half_resize_refusal = r"layer 0 (self_attn )?has 1 heads"

    # Hooks for a family whose inputs are not token ids or whose outputs are not `.logits` (e.g. ViT's images).
    def sample_inputs(self):
        return sample_ids()

    def outputs(self, model, inputs) -> torch.Tensor:
        return logits(model, inputs)

    def calibration_batch(self, inputs) -> CalibrationBatch:
        return CalibrationBatch(input_ids=inputs, attention_mask=torch.ones_like(inputs))

    def assert_generation_consistent(self, model, inputs) -> None:
        """Greedy generation with the KV cache equals generation without it (only when `generates`)."""
        with_cache, without_cache = greedy_generate_both_ways(model, inputs[:1, :5])
        assert torch.equal(with_cache, without_cache)

    # Hooks a family overrides when its config keys or block layout differ from LLaMA's.
    def expected_stacks(self) -> list[str]:
        return [self.stack]

    def expected_num_heads(self, config) -> int:
        return config.num_attention_heads

    def expected_num_kv_heads(self, config) -> int:
        return config.num_key_value_heads

    def expected_intermediate_size(self, config) -> int:
        return config.intermediate_size

    def naive_parallel(self, members, hidden, kwargs):
        return _naive_parallel(members, hidden, kwargs)

    def shallower_reference(self, model, kept):
        return shallower_reference(model, kept)

    def kept_kv_heads(self, geometry) -> list[int]:
        """The KV heads the head-pruning check keeps: the last one (a family may keep several, non-adjacent)."""
        return [geometry.num_kv_heads - 1]

    @pytest.fixture
    def model(self):
        return tiny_models.FACTORIES[self.factory]()

    def test_views_match_config(self, model):
        adapter = get_adapter(model)
        assert adapter.stacks() == self.expected_stacks()
        assert adapter.num_layers(self.stack) == getattr(model.config, self.layer_count_key)
        for block in adapter.blocks(self.stack):
            g = block.attention.geometry
            assert g.num_heads == self.expected_num_heads(model.config)
            assert g.num_kv_heads == self.expected_num_kv_heads(model.config)
            assert g.head_dim * g.num_heads == block.attention.q.out_features
            assert block.mlp.intermediate_size == self.expected_intermediate_size(model.config)
            assert block.attention.o.weight.shape == (g.hidden_size, g.num_heads * g.head_dim)
            assert block.norm_position == self.norm_position

    def test_norm_folding_preserves_logits(self, model):
        adapter = get_adapter(model)
        if self.norm_position != "pre":  # folding is the pre-norm identity; a post-norm family must refuse it
            with pytest.raises(UnsupportedArchitectureError, match="pre_norm"):
                require_capabilities(adapter, "flattengpt")
            return
        ids = self.sample_inputs()
        before = self.outputs(model, ids)
        for block in adapter.blocks(self.stack):
            assert not block.attn_norm.is_unit()
            fold_block_norms_(block)
            assert block.attn_norm.is_unit() and block.mlp_norm.is_unit()
        assert_close(self.outputs(model, ids), before)

    def test_empty_plan_changes_nothing(self, model):
        ids = self.sample_inputs()
        before = self.outputs(model, ids)
        adapter = get_adapter(model)
        adapter.keep_layers_(self.stack, list(range(adapter.num_layers(self.stack))))
        adapter.reindex_(self.stack)
        adapter.update_config_(self.stack, list(range(adapter.num_layers(self.stack))))
        adapter.validate()
        assert torch.equal(self.outputs(model, ids), before)

    def test_keep_layers_and_reindex_match_a_fresh_shallower_model(self, model):
        kept = list(self.kept_layers)
        reference = self.shallower_reference(model, kept)
        adapter = get_adapter(model)
        adapter.keep_layers_(self.stack, kept)
        adapter.reindex_(self.stack)
        adapter.update_config_(self.stack, kept)
        assert getattr(model.config, self.layer_count_key) == len(kept)
        adapter.validate()
        ids = self.sample_inputs()
        assert_close(self.outputs(model, ids), self.outputs(reference, ids))
        if self.generates:
            self.assert_generation_consistent(model, ids)

    def test_concat_before_pruning_equals_members_in_parallel(self, model):
        adapter = get_adapter(model)
        if not self.concat_supported:
            with pytest.raises(UnsupportedArchitectureError, match=self.concat_refusal):
                require_capabilities(adapter, "flattengpt")
            with pytest.raises(UnsupportedArchitectureError, match=self.concat_refusal):
                adapter.build_concat_block([adapter.detached_block(self.stack, i) for i in (1, 2)])
            return
        runner = LayerwiseRunner(adapter, [self.calibration_batch(self.sample_inputs())], self.stack)
        hidden = runner.run(adapter.layers(self.stack)[0], 0)[0]
        kwargs = runner.layer_kwargs[1][0]
        originals = [copy.deepcopy(adapter.layers(self.stack)[i]) for i in (1, 2)]
        with torch.no_grad():
            expected = self.naive_parallel(originals, hidden, kwargs)
            members = [adapter.detached_block(self.stack, i) for i in (1, 2)]
            for member in members:
                fold_block_norms_(member)
            wide = adapter.build_concat_block(members)
            view = adapter.block_view(wide, 1)
            assert view.attention.geometry.num_heads == 2 * model.config.num_attention_heads
            assert view.attention.geometry.num_kv_heads == 2 * self.expected_num_kv_heads(model.config)
            assert view.mlp.intermediate_size == 2 * self.expected_intermediate_size(model.config)
            actual = runner.run(wide, 1, [hidden])[0]
        assert_close(actual, expected)

    def test_keep_all_heads_and_channels_is_identity(self, model):
        adapter = get_adapter(model)
        ids = self.sample_inputs()
        before = self.outputs(model, ids)
        block = adapter.block(self.stack, 2)
        adapter.keep_heads_(block, list(range(block.attention.geometry.num_kv_heads)))
        if block.cross_attention is not None:
            adapter.keep_heads_(block, list(range(block.cross_attention.geometry.num_kv_heads)), cross=True)
        adapter.keep_mlp_channels_(block, list(range(block.mlp.intermediate_size)))
        assert torch.equal(self.outputs(model, ids), before)
        adapter.validate()

    def check_head_pruning(self, model, cross: bool = False) -> None:
        """Pruning KV heads (of the self- or the cross-attention of block 1) equals zeroing, in a copy, the o_proj
        columns of every query head not attached to a kept KV head."""
        adapter = get_adapter(model)

        def attention(block):
            return block.cross_attention if cross else block.attention

        block = adapter.block(self.stack, 1)
        g = attention(block).geometry
        kept_kv = self.kept_kv_heads(g)
        reference = copy.deepcopy(model)
        ref_block = get_adapter(reference).block(self.stack, 1)
        # Zeroed through the (out, in) view, which shares the parameter's memory whatever the storage layout.
        with torch.no_grad():
            o = attention(ref_block).o.weight
            for head in range(g.num_heads):
                if head // g.queries_per_kv not in kept_kv:
                    o[:, head * g.head_dim : (head + 1) * g.head_dim] = 0
        adapter.keep_heads_(block, kept_kv, cross=cross)
        pruned = attention(adapter.block(self.stack, 1)).geometry
        assert (pruned.num_kv_heads, pruned.num_heads) == (len(kept_kv), len(kept_kv) * g.queries_per_kv)
        ids = self.sample_inputs()
        assert_close(self.outputs(model, ids), self.outputs(reference, ids))

    def test_gqa_head_pruning_keeps_queries_with_their_kv_heads(self, model):
        self.check_head_pruning(model)

    def test_mlp_channel_pruning_equals_zeroed_channels(self, model):
        adapter = get_adapter(model)
        width = adapter.block(self.stack, 3).mlp.intermediate_size
        kept = [0, 3, 4, 10, 20, width - 1]
        reference = copy.deepcopy(model)
        with torch.no_grad():
            down = get_adapter(reference).block(self.stack, 3).mlp.down.weight
            mask = torch.ones(down.shape[1], dtype=torch.bool)
            mask[kept] = False
            down[:, mask] = 0
        adapter.keep_mlp_channels_(adapter.block(self.stack, 3), kept)
        assert adapter.block(self.stack, 3).mlp.intermediate_size == len(kept)
        ids = self.sample_inputs()
        assert_close(self.outputs(model, ids), self.outputs(reference, ids))

    def test_validate_detects_a_half_done_resize(self, model):
        """A resize stopped after q (k and v untouched) is caught by `validate`."""
        adapter = get_adapter(model)
        q = adapter.block(self.stack, 0).attention.q
        rows = adapter.block(self.stack, 0).attention.geometry.head_dim
        q.set_(q.weight[:rows], None if q.bias is None else q.bias[:rows])
        with pytest.raises(ValueError, match=self.half_resize_refusal):
            adapter.validate()

    def test_validate_detects_inconsistent_config(self, model):
        adapter = get_adapter(model)
        declared = getattr(model.config, self.layer_count_key)
        adapter.keep_layers_(self.stack, [0, 1, 2])
        # "config.num_hidden_layers=6 but 3 layers"; GPT-2 spells its key "n_layer (num_hidden_layers)", a family
        # with several stacks names the stack ("config.decoder_layers=4 but 3 decoder layers").
        with pytest.raises(ValueError, match=rf"{self.layer_count_key}\)?={declared} but 3 ({self.stack} )?layers"):
            adapter.validate()


class TestLlamaMHA(AdapterConformance):
    factory = "llama_mha"


class TestLlamaGQA(AdapterConformance):
    factory = "llama_gqa"


class TestMistral(AdapterConformance):
    factory = "mistral"


class TestQwen2(AdapterConformance):
    factory = "qwen2"

    def test_per_layer_config_lists_follow_the_kept_layers(self, model):
        adapter = get_adapter(model)
        assert model.config.max_window_layers == 3
        kept = [0, 1, 4, 5]
        adapter.keep_layers_("decoder", kept)
        adapter.reindex_("decoder")
        adapter.update_config_("decoder", kept)
        assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
        assert model.config.max_window_layers == 2
        adapter.validate()


class TestQwen3(AdapterConformance):
    factory = "qwen3"
    concat_supported = False


class TestPhi3(AdapterConformance):
    """Every view of Phi-3 reads a part of a fused map: q, k, v of qkv_proj ([16 | 8 | 8] rows per head_dim under
    GQA), gate and up of gate_up_proj; the concatenation check also runs a wide block whose query width differs
    from the config's (the attention gets its own count while it is wide)."""

    factory = "phi3"
    half_resize_refusal = "unequal q/k/v parts"

    def test_concat_then_prune_back_to_one_member_restores_it_and_the_shared_config(self, model):
        adapter = get_adapter(model)
        ids = self.sample_inputs()
        before = self.outputs(model, ids)
        members = [adapter.detached_block(self.stack, i) for i in (1, 3)]
        for member in members:
            fold_block_norms_(member)
        wide = adapter.build_concat_block(members)
        assert wide.self_attn.config is not model.config and wide.self_attn.config.num_attention_heads == 8
        view = adapter.block_view(wide, 1)
        adapter.keep_heads_(view, [0, 1])  # the first member's key/value heads and their queries
        adapter.keep_mlp_channels_(adapter.block_view(wide, 1), list(range(model.config.intermediate_size)))
        assert wide.self_attn.config is model.config
        adapter.replace_block_(self.stack, 1, wide)
        adapter.validate()
        assert_close(self.outputs(model, ids), before)

    def test_a_half_done_gate_up_resize_is_caught(self, model):
        adapter = get_adapter(model)
        up = adapter.block(self.stack, 0).mlp.up
        up.set_(up.weight[:8])
        with pytest.raises(ValueError, match="unequal gate/up parts"):
            adapter.validate()


def test_unknown_architecture_lists_supported_types():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=50
    )
    model = GPTNeoXForCausalLM(config)
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt_neox'.*Supported model types: \[.*'llama'"):
        get_adapter(model)
