"""The families of issue 30 on tiny random models: every layer-drop method compresses them, the saved checkpoint
reloads with plain transformers to the same logits, cached generation equals uncached, and the methods whose algebra
the family breaks are refused with the reason before any weight changes."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import (
    assert_refused_before_any_change,
    assert_reloads_with_plain_transformers,
    compress,
    greedy_generate_both_ways,
    logits,
    sample_ids,
)
from optimum_flatten import get_adapter
from optimum_flatten.methods.compensation import fold_stream_scales_

FAMILIES = sorted(tiny_models.NEW_FAMILIES)
POST_SUBLAYER_NORM = {"gemma2", "gemma3_text", "gemma3", "glm4", "olmo2"}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}

#: (method, options) of every layer-drop run; `auto` scores candidates on held-out batches.
LAYER_DROPS = {
    "shortgpt": {},
    "sleb": {},
    "uidl": {},
    "replaceme": {},
    "compensation": {"method": "shortgpt", "compensation": "scale"},
    "auto": {"batch_size": 2},
}


def _refusal(family: str, run: str) -> str | None:
    """The reason a family refuses a layer-drop run, or None when it applies."""
    if run == "replaceme":
        if family in POST_SUBLAYER_NORM:
            return "norm|down_proj"
        if family in MOE:
            return "every expert"
        if family == "granite":
            return "residual_multiplier"
    if run == "compensation" and family == "olmo2":
        return "norm"
    return None


@pytest.mark.parametrize("run", sorted(LAYER_DROPS))
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_drops_compress_reload_plain_and_generate_with_cache(family, run, tmp_path):
    model = tiny_models.FACTORIES[family]()
    options = {"num_layers_to_remove": 2, **LAYER_DROPS[run]}
    method = options.pop("method", run)
    if (reason := _refusal(family, run)) is not None:
        assert_refused_before_any_change(model, method, reason, **options)
        return
    before = logits(model, sample_ids())
    compress(model, method, **options)
    text_config = model.config.get_text_config(decoder=True)  # Gemma 3's stack is described in its text_config
    assert text_config.num_hidden_layers == 4 == len(get_adapter(model).layers())
    assert not torch.equal(logits(model, sample_ids()), before)  # a real change, not a no-op
    assert_reloads_with_plain_transformers(model, tmp_path)
    with_cache, without_cache = greedy_generate_both_ways(model, sample_ids()[:1, :5])
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize(
    ("family", "reason"),
    [(f, "post-sublayer norm|norm follows each sublayer|parameter differences") for f in sorted(POST_SUBLAYER_NORM)]
    + [(f, "experts|router") for f in sorted(MOE)],
)
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("flattengpt", {"num_layers_to_remove": 2}),
        ("come", {"num_layers_to_remove": 2}),
        ("laco", {"num_layers_to_remove": 2, "threshold": 0.01}),
        ("sliding_window", {"num_layers_to_remove": 2, "threshold": 0.01}),
    ],
)
def test_merges_whose_algebra_the_family_breaks_are_refused_unchanged(family, reason, method, options):
    assert_refused_before_any_change(tiny_models.FACTORIES[family](), method, reason, **options)


@pytest.mark.parametrize("family", sorted(MOE))
def test_ffn_merge_is_refused_on_experts(family):
    assert_refused_before_any_change(
        tiny_models.FACTORIES[family](), "ffn_merge", "router over experts", window_size=2, num_windows=1
    )


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"olmo2"}))
def test_the_compensation_fold_leaves_the_function_unchanged(family):
    """Scaling every stream write and the embeddings by one factor is invisible through the norms (Gemma's
    ``1 + weight`` post-norm gains, every expert's down projection, Granite's multipliers, tied heads)."""
    model = tiny_models.FACTORIES[family]()
    for module in model.modules():  # the fold is exact up to the norms' ε
        for name in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-12)
    ids = sample_ids()
    before = logits(model, ids)
    adapter = get_adapter(model)
    fold_stream_scales_(adapter, "decoder", [1.7] * adapter.num_layers(), 1.7)
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["smollm3", "granite"])
def test_flattengpt_on_the_llama_like_families(family, tmp_path):
    model = tiny_models.FACTORIES[family]()
    if family == "smollm3":  # NoPE layers 2 and 5 may not be merged with RoPE ones: keep the merges below layer 2
        model.config.no_rope_layers = [1] * 6
        for layer in model.model.layers:
            layer.self_attn.use_rope = 1
    compress(model, "flattengpt", num_layers_to_remove=2)
    assert_reloads_with_plain_transformers(model, tmp_path)
    with_cache, without_cache = greedy_generate_both_ways(model, sample_ids()[:1, :5])
    assert torch.equal(with_cache, without_cache)


def test_smollm3_merge_of_rope_and_nope_layers_is_refused_unchanged():
    from optimum_flatten.adapters.per_layer import LayerKindMergeError

    model = tiny_models.FACTORIES["smollm3"]()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(LayerKindMergeError, match="no_rope_layers"):
        compress(model, "laco", num_layers_to_remove=1, window_size=2, threshold=0.01, min_layer=1, max_layer=2)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_qwen2_moe_drop_keeps_each_layers_sparsity_on_reload(tmp_path):
    model = tiny_models.FACTORIES["qwen2_moe"]()
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    kept = quantizer.plan.first_indices
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [type(layer.mlp).__name__ for layer in reloaded.model.layers] == [kinds[i] for i in kept]
