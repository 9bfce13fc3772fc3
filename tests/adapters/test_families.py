"""The families of issue 30 on tiny random models: every layer-drop method compresses them, the saved checkpoint
reloads with plain transformers to the same logits (in this process, and for the second part's families also in a
fresh interpreter that never imports optimum_flatten), cached generation equals uncached, the merges a family's
algebra allows do the same, and the methods whose algebra the family breaks are refused with the reason before any
weight changes; a hybrid linear-attention stack is refused by the registry in one line."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

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
from optimum_flatten.corrections.compensation import fold_stream_scales_

FAMILIES = sorted(tiny_models.NEW_FAMILIES)
POST_SUBLAYER_NORM = {"gemma2", "gemma3_text", "gemma3", "glm4", "olmo2"}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}

#: (method, options) of every layer-drop run; `auto` scores candidates on held-out batches.
LAYER_DROPS = {
    "shortgpt": {},
    "sleb": {},
    "uidl": {},
    "replaceme": {},
    # The per-channel map: the bridge every family holds (into the norm after the MLP where one follows it).
    "replaceme_diagonal": {"method": "replaceme", "estimator": "diagonal"},
    "compensation": {"method": "shortgpt", "compensation": "scale"},
    "auto": {"batch_size": 2},
}


def _refusal(family: str, run: str) -> str | None:
    """The reason a family refuses a layer-drop run, or None when it applies."""
    if run == "replaceme":
        if family in POST_SUBLAYER_NORM:
            return "norm|down_proj"
    if run == "compensation" and family == "olmo2":
        return "norm"
    if run == "compensation" and family == "gemma3":  # the projector writes image features the fold leaves unscaled
        return "also writes image features into the stream"
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


def test_smollm3_merge_of_rope_and_nope_layers_is_never_planned_and_refused_unchanged():
    """Layers 1-2 are RoPE and NoPE: LaCo's only window there is no candidate, so the target is out of reach, refused
    before calibrating (it was scored, and before that planned, then refused); a plan that mixes them is still refused
    by the adapter, and nothing changed."""
    from optimum_flatten.adapters.per_layer import LayerKindMergeError

    model = tiny_models.FACTORIES["smollm3"]()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"the layer range \[1, 2\] can lose at most 0 that way, fewer than the 1"):
        compress(model, "laco", num_layers_to_remove=1, window_size=2, threshold=0.01, min_layer=1, max_layer=2)
    with pytest.raises(LayerKindMergeError, match="no_rope_layers"):
        get_adapter(model).check_plan_config("decoder", [[0], [1, 2], [3], [4], [5]])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_qwen2_moe_drop_keeps_each_layers_sparsity_on_reload(tmp_path):
    model = tiny_models.FACTORIES["qwen2_moe"]()
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    kept = quantizer.plan.first_indices
    quantizer.save(model, tmp_path)  # the product's own save: it asks every method whether the model is its own
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [type(layer.mlp).__name__ for layer in reloaded.model.layers] == [kinds[i] for i in kept]


#: The merges, with the options the refusal test above uses; which of them each family of the second part allows.
MERGES = {
    "flattengpt": {"num_layers_to_remove": 2},
    "come": {"num_layers_to_remove": 2},
    "laco": {"num_layers_to_remove": 2, "threshold": 0.01},
    "sliding_window": {"num_layers_to_remove": 2, "threshold": 0.01},
    "ffn_merge": {"window_size": 2, "num_windows": 1},
}
#: Phi-3 is a LLaMA block behind fused maps: every merge. GLM-4 and Gemma 3's image-text model normalise each
#: sublayer's output: only ffn_merge, which averages aligned MLPs and never sums or folds sublayer outputs.
MERGE_RUNS = [("phi3", m) for m in sorted(MERGES)] + [("glm4", "ffn_merge"), ("gemma3", "ffn_merge")]


@pytest.mark.parametrize(("family", "method"), MERGE_RUNS)
def test_merges_compress_reload_plain_and_generate_with_cache(family, method, tmp_path):
    model = tiny_models.FACTORIES[family]()
    before = logits(model, sample_ids())
    compress(model, method, **MERGES[method])
    assert model.config.get_text_config(decoder=True).num_hidden_layers == len(get_adapter(model).layers())
    assert not torch.equal(logits(model, sample_ids()), before)
    assert_reloads_with_plain_transformers(model, tmp_path)
    with_cache, without_cache = greedy_generate_both_ways(model, sample_ids()[:1, :5])
    assert torch.equal(with_cache, without_cache)


_FRESH_RELOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

spec = json.loads(sys.argv[1])
ids = torch.load(spec["ids"])
out = {}
for name, path in spec["checkpoints"].items():
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        torch.save(model(input_ids=ids, use_cache=False).logits, f"{path}/fresh_logits.pt")
        cached = model.generate(ids[:1, :5], use_cache=True, **kwargs)
        uncached = model.generate(ids[:1, :5], use_cache=False, **kwargs)
    out[name] = {"type": type(model).__name__, "cached": cached.tolist(), "uncached": uncached.tolist()}
out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "optimum_flatten")
print(json.dumps(out))
"""


def _applicable_runs(family: str) -> dict[str, tuple[str, dict]]:
    """run name -> (method, options) of every layer drop and merge `family` allows."""
    runs = {}
    for run, options in LAYER_DROPS.items():
        if _refusal(family, run) is None:
            options = {"num_layers_to_remove": 2, **options}
            runs[run] = (options.pop("method", run), options)
    runs.update({m: (m, dict(MERGES[m])) for f, m in MERGE_RUNS if f == family})
    return runs


@pytest.mark.parametrize("family", ["phi3", "glm4", "gemma3"])
def test_every_applicable_method_reloads_plain_in_a_fresh_process(family, tmp_path):
    """Each compressed checkpoint loads in an interpreter that never imported optimum_flatten, with the logits of
    the model that was saved and the same greedy tokens with and without the KV cache."""
    ids = sample_ids()
    expected, checkpoints = {}, {}
    for run, (method, options) in _applicable_runs(family).items():
        model = tiny_models.FACTORIES[family]()
        quantizer = compress(model, method, **options)
        checkpoints[run] = str(tmp_path / run)
        quantizer.save(model, checkpoints[run])
        with torch.no_grad():
            expected[run] = (logits(model, ids), greedy_generate_both_ways(model, ids[:1, :5])[0].tolist())
    torch.save(ids, tmp_path / "ids.pt")
    spec = json.dumps({"ids": str(tmp_path / "ids.pt"), "checkpoints": checkpoints})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_RELOAD, spec], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out.pop("imported") == []
    stock = type(tiny_models.FACTORIES[family]()).__name__
    for run, (expected_logits, expected_tokens) in expected.items():
        assert out[run]["type"] == stock, run
        torch.testing.assert_close(torch.load(f"{checkpoints[run]}/fresh_logits.pt"), expected_logits)
        assert out[run]["cached"] == out[run]["uncached"] == expected_tokens, run


def _tiny_hybrid(model_type: str):
    """Qwen3-Next or the Qwen3.5 text stack: three Gated DeltaNet layers ('linear_attention') per full attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        **tiny_models._common(num_key_value_heads=2, num_hidden_layers=4),
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_a_hybrid_linear_attention_stack_is_refused_in_one_line_naming_supported_types(model_type):
    model = _tiny_hybrid(model_type)
    assert "linear_attention" in model.config.layer_types
    message = (  # one line (no newline anywhere): what was received, why, and what is supported
        rf"^no adapter for model_type '{model_type}'.*layer_types include \['linear_attention'\]"
        r".*Supported model types: \[.*'phi3'.*\][^\n]*$"
    )
    assert_refused_before_any_change(model, "shortgpt", message, num_layers_to_remove=1)


def test_gemma3_image_text_drop_rewrites_text_config_and_leaves_the_vision_tower(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["gemma3"]()
    untouched = {
        k: v.clone() for k, v in model.state_dict().items() if not k.startswith("model.language_model.layers.")
    }
    types = list(model.config.text_config.layer_types)
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    kept = quantizer.plan.first_indices
    text = model.config.text_config
    assert (text.num_hidden_layers, text.layer_types) == (4, [types[i] for i in kept])
    assert model.config.vision_config.num_hidden_layers == 1
    assert all(torch.equal(untouched[k], v) for k, v in model.state_dict().items() if k in untouched)
    quantizer.save(model, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.text_config.layer_types == text.layer_types
    windows = [layer.self_attn.sliding_window for layer in reloaded.model.language_model.layers]
    assert windows == [4 if types[i] == "sliding_attention" else None for i in kept]


@pytest.mark.parametrize("door", ["method", "correction"])
def test_a_bridge_refusal_on_olmo2_names_methods_that_run_there(door):
    """OLMo-2's norms follow each sublayer: the refusal offered laco and sliding_window, which OLMo-2 refuses too, and
    'estimator diagonal' to a user who had given linear_replacement."""
    from optimum_flatten.utils.errors import UnsupportedArchitectureError

    model = tiny_models.FACTORIES["olmo2"]()
    method, options = ("replaceme", {}) if door == "method" else ("shortgpt", {"linear_replacement": "lstsq"})
    with pytest.raises(UnsupportedArchitectureError) as refused:
        compress(model, method, num_layers_to_remove=2, **options)
    offered = str(refused.value).split("Use a method without a linear replacement (", 1)[1].split(")", 1)[0]
    assert "laco" not in offered and "sliding_window" not in offered and "shortgpt" in offered
    assert ("linear_replacement='diagonal'" if door == "correction" else "estimator 'diagonal'") in str(refused.value)
