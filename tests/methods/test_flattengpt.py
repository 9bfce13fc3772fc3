from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, greedy_generate_both_ways, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.flattengpt import FlattenGPTConfig, FlattenGPTMethod
from optimum_flatten.ops import greedy_adjacent_groups
from optimum_flatten.options.methods.flattengpt import AUTO_SPLIT_MAX_WIDTH, resolve_covariance_dtype
from optimum_flatten.utils.errors import (
    CalibrationDataError,
    InvalidTargetError,
    UnsupportedArchitectureError,
)


def _config(**kwargs):
    base = dict(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, batch_size=4)
    base.update(kwargs)
    return FlattenConfig(**base)


def _naive_similarity(model, ids):
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states[: model.config.num_hidden_layers]
    size = len(states)
    s = torch.zeros(size, size, dtype=torch.float64)
    for i in range(size):
        for j in range(size):
            a, b = (
                states[i].double().reshape(-1, states[i].shape[-1]),
                states[j].double().reshape(-1, states[j].shape[-1]),
            )
            s[i, j] = torch.stack([a[t] @ b[t] / (a[t].norm() * b[t].norm()) for t in range(a.shape[0])]).mean()
    return s


@pytest.mark.parametrize("factory", ["llama_mha", "llama_gqa", "qwen2", "mistral"])
def test_similarity_and_plan_match_naive_recomputation(factory):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=3, length=16, seed=5)
    batches = [CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))]
    method = FlattenGPTMethod(FlattenGPTConfig(max_group_size=None))
    context = MethodContext(batches=batches, progress=False)
    adapter = get_adapter(model)
    similarity = method.similarity_matrix(adapter, context)
    reference = _naive_similarity(model, ids)
    torch.testing.assert_close(similarity, reference, atol=1e-5, rtol=0)
    plan = method.plan(adapter, context, 2)
    assert [g.indices for g in plan.groups] == greedy_adjacent_groups(reference, 2, None)


def test_padding_is_masked_out_of_every_statistic():
    """Right-padded rows give the same similarity as the same rows run alone without padding."""
    model = tiny_models.tiny_llama_gqa()
    adapter = get_adapter(model)
    lengths = [16, 9, 5]
    ids = sample_ids(batch=3, length=16, seed=7)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    padded_ids = ids.masked_fill(mask == 0, 0)
    padded = [CalibrationBatch(input_ids=padded_ids, attention_mask=mask)]
    alone = [
        CalibrationBatch(input_ids=ids[r : r + 1, :n], attention_mask=torch.ones(1, n, dtype=torch.long))
        for r, n in enumerate(lengths)
    ]
    method = FlattenGPTMethod(FlattenGPTConfig())
    s_padded = method.similarity_matrix(adapter, MethodContext(batches=padded, progress=False))
    s_alone = method.similarity_matrix(adapter, MethodContext(batches=alone, progress=False))
    torch.testing.assert_close(s_padded, s_alone, atol=1e-6, rtol=0)
    # And the whole compression agrees: same plan, same kept heads and channels.
    reports = []
    for batches in (padded, alone):
        m = copy.deepcopy(model)
        context = MethodContext(batches=batches, progress=False)
        a = get_adapter(m)
        plan = method.plan(a, context, 2)
        method.apply_(a, plan, context)
        reports.append(
            (
                plan.group_lists(),
                [(g["kept_kv_groups"], g["calibration_tokens"]) for g in context.report["groups"]],
            )
        )
    assert reports[0] == reports[1]
    assert reports[0][1][0][1] == sum(lengths)


@pytest.mark.parametrize("factory", ["llama_mha", "llama_gqa", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", ["one_pass", "sequential"])
def test_compress_changes_outputs_and_keeps_architecture(factory, mode):
    model = tiny_models.FACTORIES[factory]()
    reference = copy.deepcopy(model)
    ids = sample_ids()
    quantizer = FlattenQuantizer(_config(calibration_mode=mode), progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert model.config.num_hidden_layers == 4
    assert type(model) is type(reference)
    assert not hasattr(model.config, "quantization_config")
    out = logits(model, ids)
    assert out.shape == logits(reference, ids).shape
    assert not torch.allclose(out, logits(reference, ids), atol=1e-3), "a non-empty plan must change the outputs"
    for block in get_adapter(model).blocks():
        assert block.attention.geometry.num_heads == reference.config.num_attention_heads
        assert block.attention.geometry.num_kv_heads == reference.config.num_key_value_heads
        assert block.mlp.intermediate_size == reference.config.intermediate_size
    report = quantizer.report
    assert report["num_layers_after"] == 4 and len(report["plan"]["groups"]) == 4
    for group in report["groups"]:
        assert len(group["kept_kv_groups"]) == reference.config.num_key_value_heads
        assert sum(group["kept_channels_per_member"]) == reference.config.intermediate_size
    with_cache, without_cache = greedy_generate_both_ways(model, ids[:1, :5])
    assert torch.equal(with_cache, without_cache)


def test_one_pass_and_sequential_differ_after_the_first_group():
    results = {}
    for mode in ("one_pass", "sequential"):
        model = tiny_models.tiny_llama_gqa()
        FlattenQuantizer(_config(calibration_mode=mode), progress=False).compress(model, tiny_models.CharTokenizer())
        results[mode] = logits(model, sample_ids())
    assert not torch.allclose(results["one_pass"], results["sequential"])


def test_target_sparsity_resolves_to_layers():
    model = tiny_models.tiny_llama_gqa()
    quantizer = FlattenQuantizer(_config(num_layers_to_remove=None, target_sparsity=0.34), progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert model.config.num_hidden_layers == 4


def test_qwen3_is_refused_before_anything_changes():
    model = tiny_models.tiny_qwen3()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedArchitectureError, match=r"qwen3.*q_norm"):
        FlattenQuantizer(_config(), progress=False).compress(model, tiny_models.CharTokenizer())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_layers_to_remove=6), InvalidTargetError, "at most 5"),
        (dict(num_layers_to_remove=0), InvalidTargetError, ">= 1"),
        (
            dict(nsamples=500),
            CalibrationDataError,
            r"holds \d+ tokens, fewer than nsamples x seqlen = 500 x 24",
        ),
    ],
)
def test_bad_requests_fail_clearly_and_touch_nothing(kwargs, error, match):
    model = tiny_models.tiny_llama_gqa()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        FlattenQuantizer(_config(**kwargs), progress=False).compress(model, tiny_models.CharTokenizer())
    assert model.config.num_hidden_layers == 6
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def _naive_greedy(similarity: torch.Tensor, merges: int, limit: int | None) -> list[list[int]] | None:
    """FlattenGPT's Algorithm 1 written out: merge the adjacent pair with the top S[first of left, last of right]."""
    groups = [[i] for i in range(similarity.shape[0])]
    for _ in range(merges):
        pairs = [g for g in range(len(groups) - 1) if limit is None or len(groups[g]) + len(groups[g + 1]) <= limit]
        if not pairs:
            return None
        g = max(pairs, key=lambda g: (float(similarity[groups[g][0], groups[g + 1][-1]]), -g))
        groups[g : g + 2] = [groups[g] + groups[g + 1]]
    return groups


def test_groups_of_three_when_allowed():
    """Without a size limit a chain of three forms where its end layers' inputs are the most similar; with the default
    limit of two the same similarities cannot remove three layers. Only a plan that really lifted the limit passes."""
    model = tiny_models.tiny_llama_gqa()
    quantizer = FlattenQuantizer(_config(num_layers_to_remove=3, max_group_size=None), progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert model.config.num_hidden_layers == 3
    groups = quantizer.report["plan"]["groups"]
    similarity = torch.tensor(quantizer.report["similarity"], dtype=torch.float64)
    assert groups == _naive_greedy(similarity, 3, limit=None)
    assert max(len(g) for g in groups) == 3
    assert _naive_greedy(similarity, 3, limit=2) != groups


@pytest.mark.parametrize("exhaustive", [True, False])
def test_reconstruction_selection_finds_redundant_groups(monkeypatch, exhaustive):
    """KV groups 2 and 3 duplicate groups 0 and 1: keeping one copy of each loses nothing, and the selection
    must find such a subset whether it searches exhaustively or by backward elimination."""
    from optimum_flatten.adapters import HeadGeometry
    from optimum_flatten.methods.flattengpt import kv_groups as flattengpt

    if not exhaustive:
        monkeypatch.setattr(flattengpt, "MAX_EXHAUSTIVE_SUBSETS", 0)
    geometry = HeadGeometry(num_heads=8, num_kv_heads=4, head_dim=3, hidden_size=5)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(400, 12, generator=g, dtype=torch.float64)  # channels of KV groups 0 and 1
    activations = torch.cat([base, base], dim=1)  # groups 2 and 3 repeat them
    c = activations.T @ activations / 400
    rows = torch.randn(24, 5, generator=g, dtype=torch.float64)
    kept = flattengpt.select_kv_groups_by_reconstruction(c, rows, geometry, 2, lam=1e-9)
    assert len(kept) == 2 and {k % 2 for k in kept} == {0, 1}


def test_similarity_band_bounds_memory_and_keeps_the_needed_diagonal():
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=3, length=16, seed=5)
    batches = [CalibrationBatch(input_ids=ids, attention_mask=torch.ones_like(ids))]
    full = FlattenGPTMethod(FlattenGPTConfig()).similarity_matrix(
        get_adapter(model), MethodContext(batches, progress=False)
    )
    # A budget smaller than two copies of the states forces the narrowest band pairs need.
    method = FlattenGPTMethod(FlattenGPTConfig(max_group_size=2, similarity_memory_gb=1e-6))
    context = MethodContext(batches, progress=False)
    banded = method.similarity_matrix(get_adapter(model), context)
    assert context.report["similarity_band"] == 1
    for i in range(6):
        for j in range(6):
            if abs(i - j) <= 1:
                assert banded[i, j] == pytest.approx(full[i, j].item(), abs=1e-12)
            else:
                assert torch.isnan(banded[i, j])
    plan = method.plan(get_adapter(model), MethodContext(batches, progress=False), 2)
    assert [g.indices for g in plan.groups] == greedy_adjacent_groups(full, 2, 2)


def test_split_bfloat16_statistics_choose_what_float64_chooses():
    """`covariance_dtype="bfloat16"` (both moments from split bfloat16 products, `add_lower_split_gram_`) keeps
    the float64 reference's groups, KV groups and channels, and its refit down projection agrees to 1e-4 of the
    largest weight (the float32 path's agrees to about the same; the split's bound is 3·2⁻¹⁶ per product)."""
    original = tiny_models.tiny_llama_gqa()
    split, reference = copy.deepcopy(original), copy.deepcopy(original)
    ours = compress(split, "flattengpt", num_layers_to_remove=2, covariance_dtype="bfloat16")
    theirs = compress(reference, "flattengpt", num_layers_to_remove=2, covariance_dtype="float64")
    assert ours.plan.group_lists() == theirs.plan.group_lists()
    for a, b in zip(ours.report["groups"], theirs.report["groups"], strict=True):
        assert a["kept_kv_groups"] == b["kept_kv_groups"]
        assert a["kept_channels_per_member"] == b["kept_channels_per_member"]
    for position in range(len(ours.plan.groups)):
        down = get_adapter(split).block("decoder", position).mlp.down.weight
        expected = get_adapter(reference).block("decoder", position).mlp.down.weight
        assert float((down - expected).abs().max()) <= 1e-4 * float(expected.abs().max())


@pytest.mark.parametrize(
    ("requested", "activations", "on_gpu", "width", "expected"),
    [
        ("auto", "torch.bfloat16", True, 22016, "bfloat16"),  # LLaMA-2-7B's merged MLP on a GPU
        ("auto", "bfloat16", True, AUTO_SPLIT_MAX_WIDTH, "bfloat16"),
        ("auto", "bfloat16", True, 57344, "float32"),  # LLaMA-2-70B's: the float32 scatter keeps it on one GPU
        ("auto", "float16", True, 22016, "float32"),  # 11-bit significands do not split exactly
        ("auto", "float32", True, 22016, "float32"),
        ("auto", "bfloat16", False, 22016, "float32"),  # on a CPU the split costs twice the float32 path
        ("tf32", "bfloat16", True, 22016, "tf32"),  # an explicit choice is kept
        ("float64", "float32", False, 64, "float64"),
    ],
)
def test_the_automatic_covariance_precision(requested, activations, on_gpu, width, expected):
    assert resolve_covariance_dtype(requested, activations, on_gpu, width) == expected


def test_the_automatic_precision_on_a_cpu_is_the_float32_path_bit_for_bit():
    """The default (``"auto"``) on a CPU, bfloat16 weights included, computes exactly what ``"float32"`` computes,
    so no number measured on a CPU moves; each group's report says which precision it took."""
    original = tiny_models.tiny_llama_gqa().to(torch.bfloat16)
    auto, float32 = copy.deepcopy(original), copy.deepcopy(original)
    ours = compress(auto, "flattengpt", num_layers_to_remove=2)
    theirs = compress(float32, "flattengpt", num_layers_to_remove=2, covariance_dtype="float32")
    assert FlattenGPTConfig().covariance_dtype == "auto"
    assert [g["covariance_dtype"] for g in ours.report["groups"]] == ["float32"] * len(ours.report["groups"])
    state, expected = auto.state_dict(), float32.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    assert ours.report["groups"] == theirs.report["groups"]


@pytest.mark.parametrize("covariance_dtype", ["float32", "float64"])
def test_without_the_mlp_refit_the_same_channels_are_kept_and_down_is_only_sliced(covariance_dtype):
    """`mlp_correction=False`: the selection (heads, channels) is the default's, the up/gate rows are the same, and
    the down projection holds exactly the wide block's columns of the kept channels (no refit)."""
    original = tiny_models.tiny_llama_gqa()
    refit, sliced = copy.deepcopy(original), copy.deepcopy(original)
    options = {"num_layers_to_remove": 2, "covariance_dtype": covariance_dtype}
    with_refit = compress(refit, "flattengpt", **options)
    without = compress(sliced, "flattengpt", mlp_correction=False, mlp_target="parallel", **options)
    assert without.plan.group_lists() == with_refit.plan.group_lists()
    for ours, theirs in zip(without.report["groups"], with_refit.report["groups"], strict=True):
        assert ours["kept_kv_groups"] == theirs["kept_kv_groups"]
        assert ours["kept_channels_per_member"] == theirs["kept_channels_per_member"]
    for group in without.report["groups"]:
        position = without.plan.first_indices.index(group["members"][0])
        ours, theirs = (
            get_adapter(sliced).block("decoder", position).mlp,
            get_adapter(refit).block("decoder", position).mlp,
        )
        assert torch.equal(ours.up.weight, theirs.up.weight) and torch.equal(ours.gate.weight, theirs.gate.weight)
        assert not torch.allclose(ours.down.weight, theirs.down.weight)
        wide = torch.cat([get_adapter(original).block("decoder", m).mlp.down.weight for m in group["members"]], dim=1)
        columns = [
            next(j for j in range(wide.shape[1]) if torch.equal(ours.down.weight[:, c], wide[:, j]))
            for c in range(ours.down.weight.shape[1])
        ]
        assert len(set(columns)) == len(columns)
        width = get_adapter(original).block("decoder", 0).mlp.intermediate_size
        counts = [sum(1 for j in columns if j // width == m) for m in range(len(group["members"]))]
        assert counts == group["kept_channels_per_member"]


def test_mlp_correction_must_be_a_bool():
    with pytest.raises(TypeError, match="mlp_correction"):
        FlattenGPTConfig(mlp_correction="no")


def test_balanced_head_selection_keeps_each_members_best_groups_in_even_shares():
    """The same plan and scores as the paper's selection by importance; each merged pair keeps its members' best KV
    groups (by the reported f_i), half each (tiny LLaMA: 2 KV groups a layer, so one per member)."""
    default = compress(tiny_models.tiny_llama_gqa(), "flattengpt", num_layers_to_remove=2, head_selection="importance")
    balanced = compress(tiny_models.tiny_llama_gqa(), "flattengpt", num_layers_to_remove=2, head_selection="balanced")
    assert balanced.report["plan"] == default.report["plan"]
    # Not vacuous: by f_i alone one pair keeps both groups of one member and none of the other's.
    assert [g["kept_kv_groups_per_member"] for g in default.report["groups"]] == [[1, 1], [0, 2]]
    for ours, theirs in zip(balanced.report["groups"], default.report["groups"], strict=True):
        assert ours["kv_group_scores"] == theirs["kv_group_scores"]
        scores = torch.tensor(ours["kv_group_scores"])
        per_member = len(scores) // 2
        assert ours["kept_kv_groups_per_member"] == [1, 1]
        for member in range(2):
            own = scores[member * per_member : (member + 1) * per_member]
            kept = [k for k in ours["kept_kv_groups"] if k // per_member == member]
            assert kept == [member * per_member + int(own.argmax())]
    with pytest.raises(ValueError, match="head_selection"):
        FlattenGPTConfig(head_selection="even")


@pytest.mark.parametrize("with_target", [False, True])
def test_greedy_reconstruction_drops_what_one_refit_per_candidate_would(monkeypatch, with_target):
    """The greedy elimination scores each step's removals from one factorisation; it keeps the groups the plain
    elimination keeps, which refits every candidate subset on its own (`ridge_target_error`)."""
    from optimum_flatten.adapters import HeadGeometry
    from optimum_flatten.methods.flattengpt import kv_groups as flattengpt
    from optimum_flatten.ops.ridge import ridge_reconstruction_error, ridge_target_error

    monkeypatch.setattr(flattengpt, "MAX_EXHAUSTIVE_SUBSETS", 0)
    geometry = HeadGeometry(num_heads=12, num_kv_heads=6, head_dim=2, hidden_size=5)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(500, 24, generator=g, dtype=torch.float64) @ torch.randn(24, 24, generator=g, dtype=torch.float64)
    rows = torch.randn(24, 5, generator=g, dtype=torch.float64)
    t = a @ rows + torch.randn(500, 5, generator=g, dtype=torch.float64)
    c = a.T @ a / 500
    target = (a.T @ t / 500, float(t.square().sum()) / 500) if with_target else None
    lam = 0.3 * float(torch.trace(c)) / 24

    def error(groups):
        channels = torch.tensor(geometry.head_channels(geometry.query_heads_of(groups)))
        if target is None:
            return ridge_reconstruction_error(c, rows, channels, lam)
        return ridge_target_error(c, target[0], target[1], rows, channels, lam)

    kept = list(range(6))
    while len(kept) > 2:
        kept = min(([k for k in kept if k != drop] for drop in kept), key=error)
    assert flattengpt.select_kv_groups_by_reconstruction(c, rows, geometry, 2, lam, target) == kept
