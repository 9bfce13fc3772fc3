"""FlattenGPT's `attention_target="sequential"` against naive references: the members' attention writes from a plain
transformers forward, the kept heads' o_proj from the ridge normal equations on token matrices, the KV groups from
an exhaustive search over the same token-level error."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import tiny_models
from common import (
    assert_refused_before_any_change,
    assert_reloads_with_plain_transformers,
    compress,
    padded_batches,
)
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.calibration.stats import CrossMoment
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.flattengpt import FlattenGPTConfig, FlattenGPTMethod
from optimum_flatten.methods.flattengpt.attention_target import sequential_attention_writes, sequential_group_outputs
from optimum_flatten.ops import nystrom_down_correction
from optimum_flatten.ops.ridge import ridge_refit_to_target, ridge_target_error


def _batches() -> list[CalibrationBatch]:
    """Two batches, the second padded at the end of one row (padding must not reach any statistic)."""
    return padded_batches(2, 3, (1, 1, 5))


# ------------------------------------------------------------------------------------------------------------- ops
def test_refit_to_the_layers_own_output_is_the_nystrom_correction():
    torch.manual_seed(0)
    a = torch.randn(300, 12, dtype=torch.float64) @ torch.randn(12, 12, dtype=torch.float64)
    w = torch.randn(12, 5, dtype=torch.float64)
    c = a.T @ a / 300
    keep = torch.tensor([0, 3, 4, 7, 9])
    refit = ridge_refit_to_target(c, c @ w, w, keep, 0.3)
    torch.testing.assert_close(refit, nystrom_down_correction(c, w, keep, 0.3), rtol=1e-10, atol=1e-12)


def test_refit_and_its_error_against_the_normal_equations_on_tokens():
    torch.manual_seed(1)
    a = torch.randn(400, 10, dtype=torch.float64)
    t = torch.randn(400, 6, dtype=torch.float64) + a[:, :6] * 2
    w = torch.randn(10, 6, dtype=torch.float64)
    keep = torch.tensor([1, 2, 5, 8])
    lam = 0.7
    n = a.shape[0]
    c, s = a.T @ a / n, a.T @ t / n
    a_k = a[:, keep]
    # argmin (1/n)‖t − a_K W'‖² + λ‖W' − W_K‖², solved as written.
    eye = torch.eye(4, dtype=torch.float64)
    expected = torch.linalg.solve(a_k.T @ a_k / n + lam * eye, a_k.T @ t / n + lam * w[keep])
    refit = ridge_refit_to_target(c, s, w, keep, lam)
    torch.testing.assert_close(refit, expected, rtol=1e-10, atol=1e-12)
    error = ridge_target_error(c, s, float(t.square().sum()) / n, w, keep, lam)
    assert error == pytest.approx(float((t - a_k @ expected).square().sum()) / n, rel=1e-10)


def test_cross_moment_skips_padding_and_chunks_exactly():
    torch.manual_seed(2)
    x, y = torch.randn(2, 7, 3), torch.randn(2, 7, 4)
    mask = torch.ones(2, 7)
    mask[0, 5:] = 0
    moment = CrossMoment(3, 4, chunk_tokens=4)
    moment.update(x, y, mask)
    cross, energy = moment.finish()
    keep = mask.reshape(-1).bool()
    xs, ys = x.reshape(-1, 3)[keep].double(), y.reshape(-1, 4)[keep].double()
    torch.testing.assert_close(cross, xs.T @ ys / 12, rtol=1e-12, atol=1e-14)
    assert energy == pytest.approx(float(ys.square().sum()) / 12, rel=1e-12)


# ---------------------------------------------------------------------------------------------------- naive model
def _naive_statistics(model, batches, members: tuple[int, ...]):
    """Per real token: the wide block's o_proj input (each member's attention on the group's input x, its heads in
    member order) and the sum of the members' attention outputs in the plain sequential forward."""
    layers = model.model.layers
    seen: dict[str, object] = {}
    writes: list[torch.Tensor] = []

    def at_first(_module, args, kwargs):
        seen["x"], seen["kwargs"] = (args[0] if args else kwargs["hidden_states"]), kwargs

    def attention_out(_module, _args, output):
        writes.append(output[0])

    handles = [layers[members[0]].register_forward_pre_hook(at_first, with_kwargs=True)]
    handles += [layers[i].self_attn.register_forward_hook(attention_out) for i in members]
    z_rows, t_rows = [], []
    try:
        for batch in batches:
            writes.clear()
            with torch.no_grad():
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            x, kwargs = seen["x"], seen["kwargs"]
            real = batch.attention_mask.bool()
            t_rows.append(sum(writes)[real])  # before the calls below, which the same hooks would see
            z_parts = []
            for i in members:
                member = layers[i]
                captured = {}
                hook = member.self_attn.o_proj.register_forward_pre_hook(
                    lambda _m, args, captured=captured: captured.__setitem__("z", args[0])
                )
                try:
                    with torch.no_grad():
                        member.self_attn(
                            hidden_states=member.input_layernorm(x),
                            attention_mask=kwargs.get("attention_mask"),
                            position_ids=kwargs.get("position_ids"),
                            position_embeddings=kwargs.get("position_embeddings"),
                        )
                finally:
                    hook.remove()
                z_parts.append(captured["z"])
            z_rows.append(torch.cat(z_parts, dim=-1)[real])
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(z_rows).double(), torch.cat(t_rows).double()


def _compressed(model, **options):
    """FlattenGPT's own selection and application on `_batches()`; returns the context's report."""
    context = MethodContext(batches=_batches(), progress=False)
    method = FlattenGPTMethod(FlattenGPTConfig(**options))
    adapter = get_adapter(model)
    plan = method.plan(adapter, context, 1)
    method.apply_(adapter, plan, context)
    return context.report


def _kept_channels(kept_kv: list[int], heads_per_kv: int, head_dim: int) -> torch.Tensor:
    heads = [g * heads_per_kv + r for g in sorted(kept_kv) for r in range(heads_per_kv)]
    return torch.tensor([h * head_dim + d for h in heads for d in range(head_dim)])


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_sequential_attention_writes_match_a_plain_forward(factory):
    model = tiny_models.FACTORIES[factory]()
    batches = _batches()
    context = MethodContext(batches=batches, progress=False)
    adapter = get_adapter(model)
    runner = context.new_runner(adapter)
    # The states entering layer 2: the runner's own layers 0 and 1.
    states = runner.run(adapter.layers(context.stack)[1], 1, runner.run(adapter.layers(context.stack)[0], 0))
    writes = sequential_attention_writes(adapter, runner, context.stack, (2, 3), states)
    _, expected = _naive_statistics(model, batches, (2, 3))
    got = torch.cat([w[b.attention_mask.bool()] for w, b in zip(writes, batches, strict=True)]).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_one_run_gives_the_writes_and_the_group_outputs(factory):
    """With `outputs`, the members' run for the writes goes on through the last member: the same writes, and the
    outputs `sequential_group_outputs` gives from a run of its own, to the bit."""
    model = tiny_models.FACTORIES[factory]()
    context = MethodContext(batches=_batches(), progress=False)
    adapter = get_adapter(model)
    runner = context.new_runner(adapter)
    layers = adapter.layers(context.stack)
    states = runner.run(layers[1], 1, runner.run(layers[0], 0))
    outputs: list[torch.Tensor] = []
    writes = sequential_attention_writes(adapter, runner, context.stack, (2, 3), states, outputs)
    alone = sequential_attention_writes(adapter, runner, context.stack, (2, 3), states)
    expected = sequential_group_outputs(adapter, runner, context.stack, (2, 3), states)
    assert len(outputs) == len(expected) == len(writes) == len(alone)
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(writes, alone, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_kept_heads_o_proj_is_the_ridge_refit_towards_the_sequential_writes(factory):
    model = tiny_models.FACTORIES[factory]()
    dense = copy.deepcopy(model)
    report = _compressed(model, attention_target="sequential", head_selection="importance")
    (group,) = report["groups"]
    members = tuple(group["members"])
    z, t = _naive_statistics(dense, _batches(), members)
    layers = dense.model.layers
    attention = layers[members[0]].self_attn
    head_dim = attention.head_dim
    heads_per_kv = dense.config.num_attention_heads // dense.config.num_key_value_heads
    w = torch.cat([layers[i].self_attn.o_proj.weight.T for i in members]).detach().double()
    keep = _kept_channels(group["kept_kv_groups"], heads_per_kv, head_dim)
    n = z.shape[0]
    c = z.T @ z / n
    lam = 1.0 * float(torch.trace(c)) / c.shape[0]  # attention_ridge_ratio = 1, on the wide block's C
    z_k = z[:, keep]
    eye = torch.eye(keep.numel(), dtype=torch.float64)
    expected = torch.linalg.solve(z_k.T @ z_k / n + lam * eye, z_k.T @ t / n + lam * w[keep])
    got = model.model.layers[members[0]].self_attn.o_proj.weight.T.double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("factory", ["llama_gqa", "llama_mha"])
def test_reconstruction_keeps_the_groups_that_best_reproduce_the_sequential_writes(factory):
    model = tiny_models.FACTORIES[factory]()
    dense = copy.deepcopy(model)
    report = _compressed(model, attention_target="sequential", head_selection="reconstruction")
    (group,) = report["groups"]
    members = tuple(group["members"])
    z, t = _naive_statistics(dense, _batches(), members)
    config = dense.config
    head_dim = dense.model.layers[0].self_attn.head_dim
    heads_per_kv = config.num_attention_heads // config.num_key_value_heads
    n = z.shape[0]
    c = z.T @ z / n
    lam = float(torch.trace(c)) / c.shape[0]
    w = torch.cat([dense.model.layers[i].self_attn.o_proj.weight.T for i in members]).detach().double()

    def error(kept: tuple[int, ...]) -> float:
        keep = _kept_channels(list(kept), heads_per_kv, head_dim)
        z_k = z[:, keep]
        eye = torch.eye(keep.numel(), dtype=torch.float64)
        refit = torch.linalg.solve(z_k.T @ z_k / n + lam * eye, z_k.T @ t / n + lam * w[keep])
        return float((t - z_k @ refit).square().sum()) / n

    candidates = itertools.combinations(range(2 * config.num_key_value_heads), config.num_key_value_heads)
    assert sorted(group["kept_kv_groups"]) == list(min(candidates, key=error))


def test_sequential_target_changes_only_the_attention_refit():
    """Same plan, same kept heads by importance; only o_proj (and what the MLP then sees) differs."""
    parallel, sequential = tiny_models.tiny_llama_gqa(), tiny_models.tiny_llama_gqa()
    a = _compressed(parallel, attention_target="parallel", head_selection="importance")
    b = _compressed(sequential, attention_target="sequential", head_selection="importance")
    assert [g["members"] for g in a["groups"]] == [g["members"] for g in b["groups"]]
    assert [g["kept_kv_groups"] for g in a["groups"]] == [g["kept_kv_groups"] for g in b["groups"]]
    first = a["groups"][0]["members"][0]
    q_a, q_b = (m.model.layers[first].self_attn.q_proj.weight for m in (parallel, sequential))
    torch.testing.assert_close(q_a, q_b, rtol=0, atol=0)
    o_a, o_b = (m.model.layers[first].self_attn.o_proj.weight for m in (parallel, sequential))
    assert not torch.allclose(o_a, o_b)


def test_sequential_target_reloads_with_plain_transformers(tmp_path):
    model = tiny_models.tiny_llama_gqa()
    compress(model, "flattengpt", num_layers_to_remove=2, attention_target="sequential")
    assert_reloads_with_plain_transformers(model, tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention_target": "serial"}, "attention_target must be"),
        (
            {"attention_target": "sequential", "attention_correction": False, "head_selection": "importance"},
            "nothing uses it",
        ),
        # The paper's options without its target: the default target would be refused, with what to pass.
        ({"attention_correction": False, "head_selection": "importance"}, "attention_target='parallel'"),
    ],
)
def test_refusals_before_any_change(options, message):
    with pytest.raises(ValueError, match=message):
        FlattenGPTConfig(**options)
    assert_refused_before_any_change(
        tiny_models.tiny_llama_gqa(), "flattengpt", message, num_layers_to_remove=2, **options
    )


def test_defaults_are_the_sequential_targets_with_heads_by_reconstruction():
    """The defaults (since 2026-11-26) build exactly what the explicit options build, and differ from the paper's
    targets: the benchmarks' `flattengpt` rows rely on the first, their pinned older rows on the second."""
    default, explicit, paper = (tiny_models.tiny_llama_gqa() for _ in range(3))
    compress(default, "flattengpt", num_layers_to_remove=2)
    sequential = {"attention_target": "sequential", "head_selection": "reconstruction", "mlp_target": "sequential"}
    compress(explicit, "flattengpt", num_layers_to_remove=2, **sequential)
    parallel = {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"}
    compress(paper, "flattengpt", num_layers_to_remove=2, **parallel)
    state, other = default.state_dict(), explicit.state_dict()
    assert all(torch.equal(state[k], other[k]) for k in state)
    assert any(not torch.equal(state[k], v) for k, v in paper.state_dict().items())
