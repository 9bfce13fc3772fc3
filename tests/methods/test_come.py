"""CoMe (method="come"): the merged layers against a naive reference built from the paper's formulas, the BI shares,
exact norm folding, plain reload, and refusals before any weight changes."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiny_models
from common import compress, greedy_generate_both_ways, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.come import CoMeConfig, CoMeMethod, concat_merge
from optimum_flatten.ops.channel_sensitivity import (
    accumulate_abs_sum,
    channel_sensitivity,
    proportional_shares,
)
from optimum_flatten.utils.errors import UnsupportedArchitectureError


def _config(**kwargs) -> FlattenConfig:
    base = dict(
        method="come", num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=8, seqlen=24, batch_size=4
    )
    base.update(kwargs)
    return FlattenConfig(**base)


def _padded_batch(lengths=(16, 11, 7), seed=11) -> CalibrationBatch:
    """Right-padded rows, so every statistic must mask padding (and take each row's last *real* token)."""
    ids = sample_ids(batch=len(lengths), length=max(lengths), seed=seed)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return CalibrationBatch(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask)


# ---------------------------------------------------------------------------------------------- naive reference
def _query_rows(groups, per_kv: int, head_dim: int) -> list[int]:
    return [(g * per_kv + r) * head_dim + d for g in groups for r in range(per_kv) for d in range(head_dim)]


def _kv_rows(groups, head_dim: int) -> list[int]:
    return [g * head_dim + d for g in groups for d in range(head_dim)]


@torch.no_grad()
def _record_layers(model, ids, mask) -> dict[str, dict[int, torch.Tensor]]:
    """One full-model forward: every layer's input and output, and the inputs of its o_proj and down_proj."""
    seen: dict[str, dict[int, torch.Tensor]] = {"in": {}, "out": {}, "o": {}, "down": {}}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [
            layer.register_forward_pre_hook(
                lambda _m, a, kw, i=i: seen["in"].__setitem__(i, a[0] if a else kw["hidden_states"]),
                with_kwargs=True,
            ),
            layer.register_forward_hook(
                lambda _m, _a, out, i=i: seen["out"].__setitem__(i, out[0] if isinstance(out, tuple) else out)
            ),
            layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, a, i=i: seen["o"].__setitem__(i, a[0])),
            layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a, i=i: seen["down"].__setitem__(i, a[0])),
        ]
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


@torch.no_grad()
def _naive_come(model, batch: CalibrationBatch, num_merges: int, fold_norms: bool):
    """CoMe on a LLaMA written directly from the formulas: full-model forwards with hooks, plain torch slicing.

    Returns the merged model (a copy) and the groups of original layers. Shares: each layer's proportion
    BI / (BI_a + BI_b) of the KV groups and neurons rounded to the nearest whole number.
    """
    model = copy.deepcopy(model)
    config = model.config
    num_kv, head_dim = config.num_key_value_heads, config.head_dim
    per_kv = config.num_attention_heads // num_kv
    width = config.intermediate_size
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()
    rows = torch.arange(ids.shape[0])
    last = torch.tensor([int(torch.nonzero(r).max()) for r in real])
    groups = [[i] for i in range(config.num_hidden_layers)]
    for _ in range(num_merges):
        layers = model.model.layers
        seen = _record_layers(model, ids, mask)
        n = len(layers)

        def cos(a, b):
            return F.cosine_similarity(a.double(), b.double(), dim=-1)

        bi = [1.0 - float(cos(seen["in"][i], seen["out"][i])[real].mean()) for i in range(n)]
        distance = [
            float(torch.arccos(cos(seen["in"][p][rows, last], seen["out"][p + 1][rows, last]).clamp(-1, 1)).mean())
            / math.pi
            for p in range(n - 1)
        ]
        p = min(range(n - 1), key=lambda q: distance[q])
        share = bi[p] / (bi[p] + bi[p + 1])
        kv_a, ch_a = round(num_kv * share), round(width * share)
        kv_shares, ch_shares = [kv_a, num_kv - kv_a], [ch_a, width - ch_a]
        kept_kv, kept_ch = [], []
        for m, i in enumerate((p, p + 1)):
            layer = layers[i]
            o_score = seen["o"][i].double().abs()[real].mean(0) * layer.self_attn.o_proj.weight.double().abs().sum(0)
            group_score = o_score.reshape(num_kv, -1).sum(1)
            kept_kv.append(sorted(torch.topk(group_score, kv_shares[m]).indices.tolist()))
            neuron = seen["down"][i].double().abs()[real].mean(0) * layer.mlp.down_proj.weight.double().abs().sum(0)
            kept_ch.append(sorted(torch.topk(neuron, ch_shares[m]).indices.tolist()))
        a, b = layers[p], layers[p + 1]
        merged = copy.deepcopy(a)

        def read(layer, name, norm):
            w = getattr(layer.self_attn if name in ("q_proj", "k_proj", "v_proj") else layer.mlp, name).weight
            return w * norm.weight[None, :] if fold_norms else w

        def put(module, weight):
            module.weight.copy_(weight)

        put(
            merged.self_attn.q_proj,
            torch.cat(
                [
                    read(x, "q_proj", x.input_layernorm)[_query_rows(g, per_kv, head_dim)]
                    for x, g in zip((a, b), kept_kv, strict=True)
                ]
            ),
        )
        for name in ("k_proj", "v_proj"):
            put(
                getattr(merged.self_attn, name),
                torch.cat(
                    [
                        read(x, name, x.input_layernorm)[_kv_rows(g, head_dim)]
                        for x, g in zip((a, b), kept_kv, strict=True)
                    ]
                ),
            )
        put(
            merged.self_attn.o_proj,
            torch.cat(
                [
                    x.self_attn.o_proj.weight[:, _query_rows(g, per_kv, head_dim)]
                    for x, g in zip((a, b), kept_kv, strict=True)
                ],
                dim=1,
            ),
        )
        for name in ("gate_proj", "up_proj"):
            put(
                getattr(merged.mlp, name),
                torch.cat([read(x, name, x.post_attention_layernorm)[g] for x, g in zip((a, b), kept_ch, strict=True)]),
            )
        put(
            merged.mlp.down_proj,
            torch.cat([x.mlp.down_proj.weight[:, g] for x, g in zip((a, b), kept_ch, strict=True)], 1),
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights = torch.stack([getattr(a, norm).weight, getattr(b, norm).weight])
            getattr(merged, norm).weight.copy_(torch.ones(weights.shape[1]) if fold_norms else weights.mean(0))
        new_layers = list(layers)
        new_layers[p : p + 2] = [merged]
        model.model.layers = nn.ModuleList(new_layers)
        model.config.num_hidden_layers = len(new_layers)
        for index, layer in enumerate(new_layers):
            layer.self_attn.layer_idx = index
        groups[p : p + 2] = [groups[p] + groups[p + 1]]
    return model, groups


def _run_method(model, batches, num_to_remove: int, **options):
    adapter = get_adapter(model)
    method = CoMeMethod(CoMeConfig(**options))
    context = MethodContext(batches=batches, progress=False)
    with torch.no_grad():
        plan = method.plan(adapter, context, num_to_remove)
        method.apply_(adapter, plan, context)
        adapter.reindex_(plan.stack)
        adapter.update_config_(plan.stack, plan.first_indices)
        adapter.validate()
    return plan, context.report


@pytest.mark.parametrize("fold_norms", [False, True])
@pytest.mark.parametrize("num_merges", [1, 3])
def test_merged_layers_equal_a_naive_reference_from_the_formulas(fold_norms, num_merges):
    model = tiny_models.tiny_llama_gqa()
    batch = _padded_batch()
    expected, groups = _naive_come(model, batch, num_merges, fold_norms)
    compressed = copy.deepcopy(model)
    plan, report = _run_method(compressed, [batch], num_merges, fold_norms=fold_norms)
    assert plan.group_lists() == groups
    assert plan.rule == "come"
    if num_merges == 3:
        # Progressive: on this model the later merges take in an already merged layer (a chain), which the
        # reference re-measures on its own merged model too.
        assert any(len(g) > 2 for g in groups), groups
        assert len(report["merges"]) == 3
    got, want = compressed.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    ids = sample_ids(batch=2, length=12, seed=4)
    torch.testing.assert_close(logits(compressed, ids), logits(expected, ids), atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------------- shares
def test_shares_sum_to_the_original_counts_and_follow_block_influence():
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, _config(num_layers_to_remove=3))
    merges = quantizer.report["merges"]
    assert len(merges) == 3
    for merge in merges:
        bi_a, bi_b = merge["block_influence"]
        share = bi_a / (bi_a + bi_b)
        kv, channels = merge["kv_groups_per_member"], merge["channels_per_member"]
        assert sum(kv) == model.config.num_key_value_heads and sum(channels) == model.config.intermediate_size
        assert kv[0] == round(model.config.num_key_value_heads * share)
        assert channels[0] == round(model.config.intermediate_size * share)
        assert [len(k) for k in merge["kept_kv_groups"]] == kv
    for block in get_adapter(model).blocks():
        assert block.attention.geometry.num_kv_heads == model.config.num_key_value_heads
        assert block.mlp.intermediate_size == model.config.intermediate_size


def test_proportional_shares_round_to_whole_units():
    assert proportional_shares([0.3, 0.7], 2) == [1, 1]
    assert proportional_shares([0.3, 0.7], 2, "reference_code") == [0, 2]  # the authors' floor-the-smaller rule
    assert proportional_shares([0.2, 0.8], 3) == [1, 2]
    assert proportional_shares([0.0, 0.0], 5) == [3, 2]
    assert proportional_shares([1.0, 0.0], 4) == [4, 0]
    # Largest remainder = the integer vector with the given sum closest to the exact proportions (brute force).
    generator = torch.Generator().manual_seed(0)
    for members, total in itertools.product((2, 3), (1, 2, 3, 7, 48)):
        for _ in range(20):
            weights = torch.rand(members, generator=generator, dtype=torch.float64).tolist()
            exact = [total * w / sum(weights) for w in weights]
            candidates = [c for c in itertools.product(range(total + 1), repeat=members) if sum(c) == total]
            best = min(candidates, key=lambda c: sum((x - e) ** 2 for x, e in zip(c, exact, strict=True)))
            assert proportional_shares(weights, total) == list(best)
    with pytest.raises(ValueError, match="non-negative"):
        proportional_shares([0.5, -0.1], 2)


def test_channel_sensitivity_matches_naive_float64():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 6, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    total, count = accumulate_abs_sum(x, mask)
    tokens = [x[b, t].double() for b in range(3) for t in range(5) if mask[b, t]]
    assert count == len(tokens)
    mean_abs = torch.stack([t.abs() for t in tokens]).mean(0)
    torch.testing.assert_close(total / count, mean_abs)
    weight = torch.randn(4, 6, generator=generator)
    expected = torch.tensor([float(mean_abs[c]) * sum(abs(float(weight[o, c])) for o in range(4)) for c in range(6)])
    torch.testing.assert_close(channel_sensitivity(mean_abs, weight), expected.double())


# ------------------------------------------------------------------------------------------- exact norm folding
def _pruned_copy(layer, kv_groups, channels, config):
    """The layer with only the given KV groups (and their query heads) and MLP channels, by plain slicing."""
    per_kv = config.num_attention_heads // config.num_key_value_heads
    pruned = copy.deepcopy(layer)
    attention, mlp = pruned.self_attn, pruned.mlp
    q_rows, kv_rows = _query_rows(kv_groups, per_kv, config.head_dim), _kv_rows(kv_groups, config.head_dim)
    attention.q_proj.weight = nn.Parameter(attention.q_proj.weight[q_rows])
    attention.k_proj.weight = nn.Parameter(attention.k_proj.weight[kv_rows])
    attention.v_proj.weight = nn.Parameter(attention.v_proj.weight[kv_rows])
    attention.o_proj.weight = nn.Parameter(attention.o_proj.weight[:, q_rows])
    mlp.gate_proj.weight = nn.Parameter(mlp.gate_proj.weight[channels])
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight[channels])
    mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight[:, channels])
    return pruned


@pytest.mark.parametrize(("kv_a", "kv_b"), [([1], [0]), ([0, 1], [])])
@torch.no_grad()
def test_fold_norms_gives_exactly_the_two_pruned_layers_side_by_side(kv_a, kv_b):
    """Both layers read the same input x: the folded merge computes h = x + Σ attn_k(norm_k(x)), then
    h + Σ mlp_k(norm'_k(h)), each pruned layer with its own norm gains; averaging the norms (the paper) does not."""
    model = tiny_models.tiny_llama_gqa()
    config = model.config
    adapter = get_adapter(model)
    ids = sample_ids(batch=2, length=10, seed=2)
    captured = {}
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda _m, a, kw: captured.update(kw, hidden_states=a[0] if a else kw["hidden_states"]), with_kwargs=True
    )
    model(input_ids=ids, use_cache=False)
    handle.remove()
    kwargs = {k: v for k, v in captured.items() if k != "hidden_states"}
    x = torch.randn(captured["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(4)
    width = config.intermediate_size
    ch_a = sorted(torch.randperm(width, generator=generator)[:20].tolist())
    ch_b = sorted(torch.randperm(width, generator=generator)[: width - 20].tolist())
    layers = model.model.layers
    pruned = [_pruned_copy(layers[2], kv_a, ch_a, config), _pruned_copy(layers[3], kv_b, ch_b, config)]

    def attention(layer, h):
        return layer.self_attn(
            hidden_states=layer.input_layernorm(h),
            attention_mask=kwargs["attention_mask"],
            position_embeddings=kwargs["position_embeddings"],
        )[0]

    h = x + sum(attention(p, x) for p in pruned)
    expected = h + sum(p.mlp(p.post_attention_layernorm(h)) for p in pruned)

    def merged(fold: bool):
        members = [adapter.detached_block("decoder", 2), adapter.detached_block("decoder", 3)]
        block = concat_merge(adapter, members, [kv_a, kv_b], [ch_a, ch_b], fold_norms=fold)
        out = block(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    torch.testing.assert_close(merged(True), expected, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(merged(False), expected, atol=1e-3), "averaged norms are an approximation"
    # The model itself was never written to.
    fresh = tiny_models.tiny_llama_gqa().model.layers[2]
    assert torch.equal(layers[2].input_layernorm.weight, fresh.input_layernorm.weight)


# ----------------------------------------------------------------------------------------- whole compression
@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "gpt2", "baichuan"])
def test_compress_changes_outputs_and_keeps_the_architecture(factory):
    model = tiny_models.FACTORIES[factory]()
    reference = copy.deepcopy(model)
    ids = sample_ids()
    quantizer = compress(model, _config(num_layers_to_remove=3))
    assert model.config.num_hidden_layers == 3 and type(model) is type(reference)
    # The plan is what the recorded merges build, each taking the pair of smallest distance (lowest on ties).
    groups = [[i] for i in range(6)]
    for merge in quantizer.report["merges"]:
        k = merge["distances"].index(min(merge["distances"]))
        assert merge["members"] == groups[k : k + 2] and merge["angular_distance"] == merge["distances"][k]
        groups[k : k + 2] = [groups[k] + groups[k + 1]]
    assert quantizer.report["plan"]["groups"] == groups and len(quantizer.report["merges"]) == 3
    assert not torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-3), "a merge changes the outputs"
    if hasattr(model, "generate"):  # the tiny remote-code Baichuan has none (validate checked its KV cache)
        with_cache, without_cache = greedy_generate_both_ways(model, ids[:1, :5])
        assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("fold_norms", [False, True])
def test_vit_encoder_with_layernorm_biases(fold_norms):
    """Pre-LN ViT: LayerNorm biases are averaged (or folded) with the gains; heads and width stay the config's."""
    model = tiny_models.tiny_vit()
    pixels = tiny_models.sample_pixel_values(3, seed=5)
    with torch.no_grad():
        before = model(pixel_values=pixels).logits
    config = FlattenConfig(
        method="come",
        num_layers_to_remove=2,
        dataset=tiny_models.sample_pixel_values(12, seed=1),
        nsamples=8,
        seqlen=24,
        batch_size=4,
        fold_norms=fold_norms,
    )
    FlattenQuantizer(config, progress=False).compress(model)
    assert model.config.num_hidden_layers == len(model.vit.layers) == 4
    for block in get_adapter(model).blocks():
        assert block.attention.geometry.num_heads == model.config.num_attention_heads
        assert block.mlp.intermediate_size == model.config.intermediate_size
    with torch.no_grad():
        assert not torch.allclose(model(pixel_values=pixels).logits, before, atol=1e-3)


def test_without_chaining_every_group_is_a_pair():
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, _config(num_layers_to_remove=2, allow_chaining=False))
    assert all(len(g) <= 2 for g in quantizer.report["plan"]["groups"])


@pytest.mark.parametrize(("factory", "options"), [("llama_gqa", {}), ("qwen2", {"fold_norms": True}), ("gpt2", {})])
def test_save_and_plain_reload_give_the_same_logits(tmp_path, factory, options):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES[factory]()
    quantizer = compress(model, _config(num_layers_to_remove=3, **options))
    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_hidden_layers == 3
    ids = sample_ids(batch=2, length=16, seed=3)
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


# --------------------------------------------------------------------------------------------------- refusals
def _unchanged(model, state) -> bool:
    return all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_family_without_the_head_and_channel_views_is_refused_before_any_change():
    model = tiny_models.tiny_qwen3()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedArchitectureError, match=r"'come' needs \['concat_heads'\].*q_norm"):
        compress(model, _config())
    assert model.config.num_hidden_layers == 6 and _unchanged(model, state)


def test_a_target_chaining_would_need_is_refused_before_any_change():
    model = tiny_models.tiny_llama_gqa()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # 6 layers hold at most 3 disjoint pairs; 4 merges need a chain.
    with pytest.raises(ValueError, match="allow_chaining=False"):
        FlattenQuantizer(_config(num_layers_to_remove=4, allow_chaining=False), progress=False).compress(
            model, tiny_models.CharTokenizer()
        )
    assert model.config.num_hidden_layers == 6 and _unchanged(model, state)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(fold_norms="yes"), "fold_norms must be True or False"),
        (dict(allow_chaining=1), "allow_chaining must be True or False"),
        (dict(share_rounding="floor"), "share_rounding must be 'nearest' or 'reference_code'"),
    ],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        _config(**options)


def test_apply_refuses_a_plan_it_did_not_build():
    from optimum_flatten.plan import LayerPlan

    model = tiny_models.tiny_llama_gqa()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = LayerPlan(num_layers=6, groups=[(0,), (1, 2), (3,), (4,), (5,)], rule="come")
    with pytest.raises(ValueError, match="builds its merged layers while planning"):
        CoMeMethod(CoMeConfig()).apply_(get_adapter(model), plan, MethodContext(batches=[], progress=False))
    assert model.config.num_hidden_layers == 6 and _unchanged(model, state)


@pytest.mark.parametrize("removed", [1, 2])
def test_the_planner_merges_only_layers_of_one_kind(removed):
    """SmolLM3 with NoPE on layers 2 and 5: CoMe chose among every adjacent pair and then had its plan refused for
    merging a RoPE layer with a NoPE one, though (0, 1) and (3, 4) were there to merge. It now chooses among the
    pairs of one kind, and the model saves with the per-layer list kept right."""
    model = tiny_models.tiny_smollm3()
    quantizer = compress(model, "come", num_layers_to_remove=removed)
    groups = [g for g in quantizer.plan.group_lists() if len(g) > 1]
    assert groups and all(set(g) <= {0, 1} or set(g) <= {3, 4} for g in groups)
    assert model.config.no_rope_layers == [1, 0, 1, 0] if removed == 2 else len(model.config.no_rope_layers) == 5
