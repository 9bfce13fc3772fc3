"""Mixtures of experts in the estimates: the flops of a forward count the experts a token is routed to, and the
temporaries of a sparse layer's forward are what transformers' experts forward allocates.

- FLOPs: a token runs its top-k experts, the router and any shared expert, not every expert the layer holds. The
  unit of the arithmetic (``dense_forward_flops``, in `estimate --json` and in a compression's report) and the
  roofline's seconds of a forward (`estimate --device`) are checked against a count written here from the config:
  2 x (the attention and norm weights, the router, k experts' gate/up/down, the shared expert and its gate) per
  token and layer, plus attention's token-pair products (`utils.flops`).
- Memory: one sparse decoder layer's forward on one batch runs under `LiveBytes` (tests/test_estimate.py), which
  counts every storage an aten op allocates until it is freed; its peak (the layer's input, held by the runner,
  excluded) is compared with `WorkspaceSizes.block_forward`, the term every method's estimate builds on.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

import tiny_models
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.cli.main import main
from optimum_flatten.compression.workspace import WorkspaceSizes
from optimum_flatten.estimate import CalibrationShape, ModelShape
from optimum_flatten.roofline import DEVICES, FORWARD_EFFICIENCY
from test_estimate import LiveBytes

MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _is_sparse(config: Any, index: int) -> bool:
    """Which layers have a sparse MLP, as the families' decoder layers decide it (transformers 5.x)."""
    if config.model_type == "mixtral":
        return True
    step = getattr(config, "decoder_sparse_step", 1)
    return index not in config.mlp_only_layers and config.num_experts > 0 and (index + 1) % step == 0


def _mlp_weights_one_token_runs(config: Any, index: int) -> int:
    """The MLP weights one token is multiplied by in layer `index`, from the config alone."""
    d = config.hidden_size
    if not _is_sparse(config, index):
        return 3 * d * config.intermediate_size  # a dense gated MLP
    if config.model_type == "mixtral":
        experts, k, width = config.num_local_experts, config.num_experts_per_tok, config.intermediate_size
    else:
        experts, k, width = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    router = experts * d
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    shared_weights = 3 * d * shared + d if shared else 0  # the shared expert and its sigmoid gate (d -> 1)
    return router + k * 3 * d * width + shared_weights


def _naive_forward_flops(model: nn.Module, tokens: int, seqlen: int) -> float:
    """One forward of the decoder stack over `tokens` tokens: 2 x the weights each token runs, plus 4 x seqlen x
    (heads x head_dim) per token and layer for attention's two token-pair products."""
    config = model.config
    weights = 0
    for index, layer in enumerate(model.model.layers):
        # Attention and norms as built (biases, q/k norms), the MLP from the config: the part under test.
        weights += sum(p.numel() for name, p in layer.named_parameters() if not name.startswith("mlp."))
        weights += _mlp_weights_one_token_runs(config, index)
    width = config.num_attention_heads * config.head_dim
    return 2.0 * weights * tokens + 4.0 * tokens * seqlen * width * config.num_hidden_layers


def _every_expert_flops(model: nn.Module, tokens: int, seqlen: int) -> float:
    """What was counted before: every weight of the stack, every expert included."""
    weights = sum(p.numel() for p in model.model.layers.parameters())
    config = model.config
    width = config.num_attention_heads * config.head_dim
    return 2.0 * weights * tokens + 4.0 * tokens * seqlen * width * config.num_hidden_layers


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_estimate_counts_the_flops_of_the_routed_experts(family, tmp_path, capsys):
    model = tiny_models.FACTORIES[family]()
    model.config.save_pretrained(tmp_path)
    argv = ["estimate", str(tmp_path), "--method", "shortgpt", "--num-layers-to-remove", "1"]
    assert main([*argv, "--nsamples", "8", "--seqlen", "128", "--batch-size", "8", "--json", "--device", "h100"]) == 0
    result = json.loads(capsys.readouterr().out)
    naive = _naive_forward_flops(model, 8 * 128, 128)
    assert result["dense_forward_flops"] == pytest.approx(naive, rel=1e-9)
    assert naive < _every_expert_flops(model, 8 * 128, 128)  # the count it replaces: every expert's weights
    # The roofline's forward: compute-bound at this batch, so its seconds are the routed flops at the forward rate.
    forward = naive / (DEVICES["h100"].peak("float32") * FORWARD_EFFICIENCY)
    assert result["prediction"]["dense_forward_seconds"] == pytest.approx(forward, rel=1e-9)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_compression_report_counts_the_flops_of_the_routed_experts(family):
    model = tiny_models.FACTORIES[family]()
    naive = _naive_forward_flops(model, 4 * 32, 32)  # counted on the dense model, before any layer goes
    config = FlattenConfig(
        method="shortgpt",
        num_layers_to_remove=1,
        dataset=tiny_models.sample_texts(200),
        nsamples=4,
        seqlen=32,
        batch_size=2,
    )
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert quantizer.report["calibration"]["tokens"] == 4 * 32  # packed: every position is a real token
    assert quantizer.report["cost"]["arithmetic"]["dense_forward_flops"] == pytest.approx(naive, rel=1e-9)


# ------------------------------------------------------------------------------------------ a sparse layer's memory
SMALL = dict(
    vocab_size=1000,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(
        intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, **SMALL
    ),
    "qwen2_moe shared expert": lambda: Qwen2MoeConfig(
        intermediate_size=512,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=384,
        num_experts=8,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        **SMALL,
    ),
    "qwen3_moe after a wide dense layer": lambda: Qwen3MoeConfig(
        intermediate_size=2048,
        moe_intermediate_size=384,
        num_experts=8,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        mlp_only_layers=[0],
        **SMALL,
    ),
}


def _measured_layer_peak(model: nn.Module, batch: int, seqlen: int) -> int:
    """The largest bytes any decoder layer's forward allocates on one batch beyond its input (weights and input are
    held before the layer runs), as `LayerwiseRunner` calls it: the states, the rotary tables, the positions."""
    dtype = next(model.parameters()).dtype
    states = torch.randn(batch, seqlen, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    states = states.to(dtype)
    positions = torch.arange(seqlen).unsqueeze(0).expand(batch, -1)
    rotary = model.model.rotary_emb(states, positions)
    peaks = []
    with torch.no_grad():
        for layer in model.model.layers:
            tracker = LiveBytes()
            with tracker:
                layer(states, attention_mask=None, position_embeddings=rotary, position_ids=positions)
            peaks.append(tracker.peak)
    return max(peaks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_sparse_layers_forward_is_estimated_from_what_its_experts_forward_allocates(name, dtype):
    """Modelled as a dense MLP of the active width (3·k·i + 2·d per token) it was 30% under the measured peak of
    Mixtral's layer: the default experts forward (``grouped_mm``) holds every (token, expert) pair at once. The
    estimate must stay an upper bound, and close."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype).eval()
    batch, seqlen = 2, 128
    measured = _measured_layer_peak(model, batch, seqlen)
    modelled = WorkspaceSizes(ModelShape.of(model), CalibrationShape(4 * batch, seqlen, batch)).block_forward()
    assert measured <= modelled <= 1.1 * measured, (modelled, measured)
