"""FlattenGPT's `mlp_target="sequential"` against a naive reference: the kept channels' down projection is the ridge
fit, on token matrices from plain transformers forwards, of what the merged block must still write after its pruned
attention (the original pair's output less the MLP's input residual), padding masked."""

from __future__ import annotations

import copy

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
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.flattengpt import FlattenGPTConfig, FlattenGPTMethod


def _batches() -> list[CalibrationBatch]:
    """Two batches, the second padded at the end of one row (padding must not reach any statistic)."""
    return padded_batches(2, 3, (1, 1, 5))


def _compress_spying(model, monkeypatch, **options):
    """FlattenGPT's own selection and application on `_batches()`; also returns what it handed to
    `keep_mlp_channels_` (the kept channels and the refitted rows of the down projection)."""
    adapter = get_adapter(model)
    handed: dict[str, object] = {}
    keep = type(adapter).keep_mlp_channels_

    def spy(self, view, kept, weight):
        handed["kept"], handed["weight"] = list(kept), weight.detach().double().clone()
        return keep(self, view, kept, weight)

    monkeypatch.setattr(type(adapter), "keep_mlp_channels_", spy)
    context = MethodContext(batches=_batches(), progress=False)
    method = FlattenGPTMethod(FlattenGPTConfig(**options))
    plan = method.plan(adapter, context, 1)
    method.apply_(adapter, plan, context)
    return context.report, handed


def _naive_rows(dense, compressed, members: tuple[int, ...], batches):
    """Per real token: the wide MLP's activations (every member's MLP, with its own norm, on the compressed block's
    MLP input residual r), and the target: the dense pair's output less r."""
    first, last = members[0], members[-1]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        compressed.model.layers[first].post_attention_layernorm.register_forward_pre_hook(
            lambda _m, args: seen.__setitem__("r", args[0])
        ),
        dense.model.layers[last].register_forward_hook(
            lambda _m, _args, output: seen.__setitem__("out", output[0] if isinstance(output, tuple) else output)
        ),
    ]
    h_rows, t_rows = [], []
    try:
        for batch in batches:
            with torch.no_grad():
                dense(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
                compressed(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
                r = seen["r"]
                parts = []
                for i in members:
                    layer = dense.model.layers[i]
                    normed = layer.post_attention_layernorm(r)
                    parts.append(layer.mlp.act_fn(layer.mlp.gate_proj(normed)) * layer.mlp.up_proj(normed))
            real = batch.attention_mask.bool()
            h_rows.append(torch.cat(parts, dim=-1)[real])
            t_rows.append((seen["out"] - r)[real])
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(h_rows).double(), torch.cat(t_rows).double()


@pytest.mark.parametrize("covariance_dtype", ["float32", "float64"])
@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_down_projection_is_the_ridge_refit_towards_what_the_pair_still_writes(factory, covariance_dtype, monkeypatch):
    model = tiny_models.FACTORIES[factory]()
    dense = copy.deepcopy(model)
    report, handed = _compress_spying(model, monkeypatch, mlp_target="sequential", covariance_dtype=covariance_dtype)
    (group,) = report["groups"]
    members = tuple(group["members"])
    h, t = _naive_rows(dense, model, members, _batches())
    n, width = h.shape
    c = h.T @ h / n
    lam = 10.0 * float(torch.trace(c)) / width  # ridge_ratio's default
    w = torch.cat([dense.model.layers[i].mlp.down_proj.weight.T for i in members]).detach().double()
    keep = torch.tensor(handed["kept"])
    h_k = h[:, keep]
    eye = torch.eye(keep.numel(), dtype=torch.float64)
    # argmin (1/n)‖t − h_K W'‖² + λ‖W' − W_K‖², solved as written.
    expected = torch.linalg.solve(h_k.T @ h_k / n + lam * eye, h_k.T @ t / n + lam * w[keep])
    torch.testing.assert_close(handed["weight"].T, expected, rtol=1e-4, atol=1e-6)
    # Not vacuous: the paper's target (Nyström, towards the wide MLP's own output) is another matrix.
    nystrom = torch.linalg.solve(h_k.T @ h_k / n + lam * eye, h_k.T @ (h @ w) / n + lam * w[keep])
    assert not torch.allclose(expected, nystrom, rtol=1e-3, atol=1e-5)


def test_sequential_mlp_target_keeps_the_channels_and_reloads_with_plain_transformers(tmp_path, monkeypatch):
    _, parallel = _compress_spying(tiny_models.tiny_llama_gqa(), monkeypatch, mlp_target="parallel")
    _, sequential = _compress_spying(tiny_models.tiny_llama_gqa(), monkeypatch, mlp_target="sequential")
    assert parallel["kept"] == sequential["kept"]  # chosen by leverage either way
    ours = tiny_models.tiny_llama_gqa()
    compress(ours, "flattengpt", num_layers_to_remove=2, mlp_target="sequential")
    assert_reloads_with_plain_transformers(ours, tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mlp_target": "serial"}, "mlp_target must be"),
        ({"mlp_target": "sequential", "mlp_correction": False}, "nothing is refitted"),
    ],
)
def test_refusals_before_any_change(options, message):
    with pytest.raises(ValueError, match=message):
        FlattenGPTConfig(**options)
    assert_refused_before_any_change(
        tiny_models.tiny_llama_gqa(), "flattengpt", message, num_layers_to_remove=2, **options
    )
