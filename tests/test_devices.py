"""Every registered method on every device it may meet: the result stays where the model was, in its dtype.

A method that builds a tensor on the default device (the CPU) or in float32 and writes it into a CUDA or bfloat16
model fails only on that device or dtype, so each method runs here on a tiny model in float32 and bfloat16, on the
CPU always and on CUDA where there is one (the `gpu` cases are skipped without it, as in CI). The CPU cases are
what shows the test can pass without a GPU; the CUDA cases are the smoke test the GPU issue asks for.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import compress, sample_ids, tiny_config
from optimum_flatten.adapters import get_adapter
from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_, prepared_mlps
from optimum_flatten.registry import get_method_class, registered_methods

#: Options a method needs on the tiny calibration (8 samples of 24 tokens) beyond `num_layers_to_remove`.
OPTIONS: dict[str, dict[str, Any]] = {
    "auto": {"batch_size": 4},  # a fitting and a validation batch
    "laco": {"threshold": None},
    "greedy_replace": {"shortlist": 2},
}

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


def _model_for(method: str) -> torch.nn.Module:
    """Tiny LLaMA (GQA) for every method but LayerCollapse, which collapses GPT-2's ungated MLPs once α = 1."""
    if method != "layer_collapse":
        return tiny_models.tiny_llama_gqa()
    model = tiny_models.tiny_gpt2()
    prepare_layer_collapse_(model, num_mlps=2)
    with torch.no_grad():
        for activation in prepared_mlps(get_adapter(model), "decoder").values():
            activation.alpha.fill_(1.0)
    return model


def _misplaced(model: torch.nn.Module, device: str, dtype: torch.dtype) -> list[tuple[str, str, torch.dtype]]:
    """Every parameter or buffer off `device` or, if floating, not in `dtype` (RoPE's float32 frequencies aside)."""
    return [
        (name, str(t.device), t.dtype)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != torch.device(device).type
        or (t.is_floating_point() and t.dtype != dtype and "inv_freq" not in name)
    ]


def test_the_table_names_only_registered_methods():
    assert set(OPTIONS) <= set(registered_methods())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", registered_methods())
def test_every_method_keeps_the_model_on_its_device_and_dtype(method, dtype, device):
    model = _model_for(method).to(device=device, dtype=dtype)
    layers_before = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else None
    method_class = get_method_class(method)
    depth = {} if method_class.keeps_depth or method == "layer_collapse" else {"num_layers_to_remove": 2}
    quantizer = compress(model, method, **depth, **OPTIONS.get(method, {}))

    assert _misplaced(model, device, dtype) == []
    if depth:
        assert model.config.num_hidden_layers == layers_before - 2
    with torch.no_grad():
        out = model(input_ids=sample_ids().to(device), use_cache=False).logits
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    assert quantizer.report["cost"]["stack_passes"] >= 0


#: FlattenGPT's options that take paths of their own (candidate blocks built and held, TF32 or split bfloat16
#: products, the float64 reference, a reconstruction search, down-refit bridges, the members' sequential attention
#: writes): each must leave the model where it was, as the defaults do.
FLATTENGPT_VARIANTS = {
    "loss_selection": {"selection": "loss"},
    "wide_loss_selection": {"selection": "wide_loss"},
    "tf32_statistics": {"covariance_dtype": "tf32"},
    "float64_statistics": {"covariance_dtype": "float64"},
    "split_bfloat16_statistics": {"covariance_dtype": "bfloat16"},
    "paper_targets": {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"},
    "importance_heads": {"head_selection": "importance"},
    "down_bridges": {"linear_replacement": "lstsq_down"},
    "parallel_mlp_target": {"mlp_target": "parallel"},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(FLATTENGPT_VARIANTS))
def test_flattengpt_options_keep_the_model_on_its_device_and_dtype(variant, dtype, device):
    model = tiny_models.tiny_llama_gqa().to(device=device, dtype=dtype)
    compress(model, "flattengpt", num_layers_to_remove=2, **FLATTENGPT_VARIANTS[variant])

    assert _misplaced(model, device, dtype) == []
    assert model.config.num_hidden_layers == 4
    with torch.no_grad():
        out = model(input_ids=sample_ids().to(device), use_cache=False).logits
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    assert bool(torch.isfinite(out).all())


#: ReplaceMe's three ways to its fit's states, chosen by the budget (tests/methods/test_replaceme_one_pass.py): held by
#: the selection walk (the tiny window fits the default), one walk batch by batch with the shortlist's statistics (the
#: window over 40 KB, two starts' statistics within it), and the streamed second walk (no budget).
REPLACEME_PATHS = {
    "held by the selection": {},
    "one pass with the selection": {"held_states_gb": 4e-5},
    "streamed": {"held_states_gb": 0},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_replaceme_fit_paths_give_one_model_on_the_device(dtype, device):
    """Each path keeps the model where it was and gives the others' weights: bit for bit on the CPU; on CUDA the
    same kernels run on the same batches in the same order, so within a rounding of the dtype."""
    weights = {}
    for path, options in REPLACEME_PATHS.items():
        model = tiny_models.tiny_llama_gqa().to(device=device, dtype=dtype)
        report = compress(model, "replaceme", num_layers_to_remove=2, **options).report
        assert report["replaceme"]["states"] == path
        assert _misplaced(model, device, dtype) == []
        weights[path] = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
    tolerance = {"atol": 0.0, "rtol": 0.0} if device == "cpu" else {"atol": 1e-5, "rtol": 1e-2}
    for path in REPLACEME_PATHS:
        for name, tensor in weights[path].items():
            torch.testing.assert_close(tensor, weights["streamed"][name], **tolerance, msg=f"{path}: {name}")


@pytest.mark.gpu
def test_the_automatic_precision_on_cuda_takes_the_split_products_for_bfloat16_activations():
    """FlattenGPT's default ``covariance_dtype="auto"`` on a bfloat16 model on CUDA is the split bfloat16 path
    (`resolve_covariance_dtype`): the same groups, KV groups and channels, and weights equal to the explicit
    ``"bfloat16"`` run's within bfloat16's rounding."""
    model = tiny_models.tiny_llama_gqa().to(device="cuda", dtype=torch.bfloat16)
    auto, split = copy.deepcopy(model), copy.deepcopy(model)
    ours = compress(auto, "flattengpt", num_layers_to_remove=2)
    theirs = compress(split, "flattengpt", num_layers_to_remove=2, covariance_dtype="bfloat16")
    assert {g["covariance_dtype"] for g in ours.report["groups"]} == {"bfloat16"}
    for a, b in zip(ours.report["groups"], theirs.report["groups"], strict=True):
        assert a["kept_kv_groups"] == b["kept_kv_groups"]
        assert a["kept_channels_per_member"] == b["kept_channels_per_member"]
    expected = split.state_dict()
    for name, tensor in auto.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["flattengpt", "shortgpt", "replaceme"])
def test_compress_on_load_with_a_cuda_device_map(tmp_path, method):
    dense_dir = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense_dir)
    config = tiny_config(method, num_layers_to_remove=2, tokenizer=tiny_models.CharTokenizer())
    model = AutoModelForCausalLM.from_pretrained(
        dense_dir, dtype=torch.bfloat16, device_map="cuda", quantization_config=config
    )
    assert model.config.num_hidden_layers == 4
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.flatten_report["method"] == method
