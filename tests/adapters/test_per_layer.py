"""Per-layer config fields (adapters/per_layer.py), checked from the configs alone, for every family's config class.

Each case builds a small config with non-uniform per-layer fields, keeps layers [0, 2, 3, 5] of 6 (what a drop of 1
and 4 leaves), and checks each field against the value written out by hand, then that `from_pretrained` reads the
rewritten config back unchanged (transformers' own post-init must not re-derive a field from a stale rule).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from optimum_flatten.adapters.per_layer import (
    LayerKindMergeError,
    check_groups_share_layer_kind,
    rewrite_per_layer_config_,
    stack_config,
)

KEPT = [0, 2, 3, 5]
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SW = ["sliding_attention", "full_attention"]

#: model_type -> (extra config kwargs, {field: expected value after keeping KEPT}).
CASES: dict[str, tuple[dict, dict]] = {
    "gemma2": ({}, {"layer_types": [SW[0], SW[0], SW[1], SW[1]]}),
    "gemma3_text": (
        {"layer_types": [SW[0], SW[0], SW[1], SW[0], SW[0], SW[1]]},
        {"layer_types": [SW[0], SW[1], SW[0], SW[1]]},
    ),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, {}),
    "qwen2_moe": (
        # Sparse on odd layers (step 2) except 5: dense 0, 2, 4, 5 -> kept 0, 2, 3(orig 5) dense, 1... see expected.
        {"decoder_sparse_step": 2, "mlp_only_layers": [5], "num_experts": 4, "moe_intermediate_size": 16},
        # kept originals 0 (dense), 2 (dense), 3 (sparse), 5 (listed dense) -> step 1, dense at new 0, 1, 3.
        {"decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 3]},
    ),
    "qwen3_moe": (
        {"mlp_only_layers": [2, 4], "num_experts": 4, "moe_intermediate_size": 16},
        {"decoder_sparse_step": 1, "mlp_only_layers": [1]},
    ),
    "olmo2": ({}, {}),
    "smollm3": ({"no_rope_layers": [1, 0, 1, 1, 0, 1]}, {"no_rope_layers": [1, 1, 1, 1]}),
    "granite": ({"residual_multiplier": 0.5, "embedding_multiplier": 4.0}, {}),
    "glm4": ({}, {}),
    "phi3": ({}, {}),
    "qwen2": (
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3},
        {"max_window_layers": 2, "layer_types": [SW[1], SW[1], SW[0], SW[0]]},
    ),
}


def _config(model_type: str, extra: dict):
    return AutoConfig.for_model(model_type, **{**SMALL, **extra})


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_rewrite_keeps_each_kept_layers_fields_and_reloads(model_type, tmp_path):
    extra, expected = CASES[model_type]
    config = _config(model_type, extra)
    changes = rewrite_per_layer_config_(config, "num_hidden_layers", KEPT)
    assert config.num_hidden_layers == len(KEPT) == changes["num_hidden_layers"]
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    # Every list with one entry per layer has the new length, whatever the family calls it.
    for key in ("layer_types", "mlp_layer_types", "no_rope_layers"):
        if isinstance(getattr(config, key, None), list):
            assert len(getattr(config, key)) == len(KEPT), key
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert reloaded.num_hidden_layers == len(KEPT)
    for key, value in expected.items():
        assert getattr(reloaded, key) == value, f"{key} changed on reload"


def test_qwen_moe_sparsity_pattern_is_kept_layer_by_layer():
    """The dense/sparse kind of every kept layer, as the modelling code derives it, is the original layer's."""
    extra, _ = CASES["qwen2_moe"]
    config = _config("qwen2_moe", extra)

    def sparse(c, i):  # transformers 5.24, models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeDecoderLayer
        return i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0

    before = [sparse(config, i) for i in KEPT]
    rewrite_per_layer_config_(config, "num_hidden_layers", KEPT)
    assert [sparse(config, i) for i in range(len(KEPT))] == before


def test_nested_text_config_of_gemma3_is_rewritten():
    from transformers import Gemma3Config

    text = {**SMALL, "layer_types": [SW[0], SW[0], SW[1], SW[0], SW[0], SW[1]]}
    config = Gemma3Config(
        text_config=text,
        vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
    )
    inner = stack_config(config, "num_hidden_layers")
    assert inner is config.text_config
    rewrite_per_layer_config_(inner, "num_hidden_layers", KEPT)
    assert config.text_config.num_hidden_layers == 4
    assert config.text_config.layer_types == [SW[0], SW[1], SW[0], SW[1]]
    assert config.vision_config.num_hidden_layers == 1


def test_per_layer_config_keys_are_renumbered(tmp_path):
    """transformers >= 5.15 heterogeneous configs: overrides keyed by layer index follow their layers."""
    config = _config(
        "llama",
        {"per_layer_config": {1: {"intermediate_size": 64}, 3: {"skip": ["mlp"]}, 5: {"intermediate_size": 40}}},
    )
    assert config.is_heterogeneous
    rewrite_per_layer_config_(config, "num_hidden_layers", KEPT)
    assert config.to_dict()["per_layer_config"] == {"2": {"skip": ["mlp"]}, "3": {"intermediate_size": 40}}
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict()["per_layer_config"] == {"2": {"skip": ["mlp"]}, "3": {"intermediate_size": 40}}


@pytest.mark.parametrize(
    ("model_type", "extra", "group", "field"),
    [
        ("gemma3_text", {"layer_types": [SW[0], SW[0], SW[1], SW[0], SW[0], SW[1]]}, [1, 2], "layer_types"),
        ("smollm3", {"no_rope_layers": [1, 0, 1, 1, 0, 1]}, [0, 1], "no_rope_layers"),
        ("qwen3_moe", {"mlp_only_layers": [2], "num_experts": 4}, [2, 3], "decoder_sparse_step"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3}, [2, 3], "layer_types"),
        ("llama", {"per_layer_config": {1: {"intermediate_size": 64}}}, [0, 1], "per_layer_config"),
    ],
)
def test_a_merge_of_layers_of_different_kinds_is_refused(model_type, extra, group, field):
    config = _config(model_type, extra)
    with pytest.raises(LayerKindMergeError, match=rf"cannot merge layers \[{group[0]}, {group[1]}\].*'{field}'"):
        check_groups_share_layer_kind(config, 6, [[0] if group[0] else [2], group])


def test_a_merge_of_layers_of_one_kind_passes():
    config = _config("gemma3_text", {"layer_types": [SW[0], SW[0], SW[1], SW[0], SW[0], SW[1]]})
    check_groups_share_layer_kind(config, 6, [[0, 1], [2], [3, 4], [5]])


def test_a_per_layer_list_of_the_wrong_length_is_refused():
    config = _config("smollm3", {})
    config.no_rope_layers = [1, 0, 1]  # a hand-edited config: transformers itself would fail on it at load
    with pytest.raises(ValueError, match="no_rope_layers must have one entry per layer"):
        rewrite_per_layer_config_(config, "num_hidden_layers", KEPT)


@pytest.mark.parametrize(
    ("kept", "pattern"),
    [([0, 1, 2, 6, 7, 8, 9, 10, 11], 3), ([0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11], None), ([0, 1, 3, 4], 5)],
    ids=["a whole period removed", "a period cut", "no full layer kept"],
)
def test_gemmas_older_sliding_window_pattern_is_kept_only_where_the_kept_layers_follow_it(kept, pattern, tmp_path):
    """Hub configs of Gemma 2/3 still carry ``sliding_window_pattern`` (layer i full when (i + 1) % p == 0), which
    readers older than ``layer_types`` go by: after a removal it is the period the kept layers follow, or gone."""
    config = AutoConfig.for_model("gemma3_text", **{**SMALL, "num_hidden_layers": 12, "sliding_window_pattern": 3})
    rewrite_per_layer_config_(config, "num_hidden_layers", kept)
    # The naive reference: each kept layer's type under the original rule.
    expected = [SW[1] if (i + 1) % 3 == 0 else SW[0] for i in kept]
    assert config.layer_types == expected
    saved = config.to_dict()
    assert saved.get("sliding_window_pattern") == pattern and saved.get("_sliding_window_pattern") == pattern
    if pattern is not None:
        assert expected == [SW[1] if (i + 1) % pattern == 0 else SW[0] for i in range(len(kept))]
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).layer_types == expected
