"""The arithmetic count (`utils.flops`) against hand-computed values: each op records what its shapes imply, the
phases of `MethodContext.timer` receive it, and a compression's report carries it per phase."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import tiny_models
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.calibration.stats import CentredSecondMoment, CrossMoment, SecondMoment
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.ops.ridge import nystrom_down_correction, ridge_factor, ridge_leverage_scores
from optimum_flatten.ops.selection import balanced_top_k, top_k_indices
from optimum_flatten.utils import flops
from optimum_flatten.utils.flops import ArithmeticCount


def _counted(function, *args, **kwargs) -> dict[str, dict[str, float]]:
    count = ArithmeticCount()
    with count.phase("here"):
        function(*args, **kwargs)
    return count.phases["here"]


def test_second_moments_count_two_n_d_squared_over_the_real_tokens():
    """n real tokens of d features: Xᵀ X is 2·n·d² flops, whatever the path; padding is not counted."""
    x = torch.randn(2, 5, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    n, d = 8, 6
    for moment, precision in (
        (SecondMoment(d), "float32"),
        (SecondMoment(d, tf32=True), "tf32"),  # what a GPU runs; the CPU has no TF32, the count is the same
        (CentredSecondMoment(d), "float32"),
        (CentredSecondMoment(d, tf32=True), "tf32"),
    ):
        assert _counted(moment.update, x, mask) == {"product": {precision: 2 * n * d * d}}
    assert _counted(SecondMoment(d).update, x.double(), mask) == {"product": {"float64": 2 * n * d * d}}
    cross = CrossMoment(d, 3, chunk_tokens=3)  # chunks change the order, not the count
    assert _counted(cross.update, x, torch.randn(2, 5, 3), mask) == {"product": {"float64": 2 * n * d * 3}}


def test_factorisations_and_solves_count_their_lapack_operation_counts():
    torch.manual_seed(0)
    a = torch.randn(40, 12, dtype=torch.float64)
    c = a.T @ a / 40
    assert _counted(ridge_factor, c.clone(), 0.1) == {
        "factorisation": {"float64": 12**3 / 3},
        "host_reads": {"count": 2},  # the jitter's scale and the factorisation's status
    }
    # Leverage: the factor (n³/3), then L⁻¹ by panels of 5 columns against the trailing triangle: Σ (n − s)²·5.
    counted = _counted(ridge_leverage_scores, c.clone(), 0.1, block_size=5)
    assert counted["factorisation"]["float64"] == pytest.approx(12**3 / 3 + 12**2 * 5 + 7**2 * 5 + 2**2 * 2)
    # Nyström with k = 8 kept of 12, hidden 4: C_KR W_R (2·k·r·h), the kept factor (k³/3), the solve (2·k²·h).
    keep = torch.arange(8)
    counted = _counted(nystrom_down_correction, c, torch.randn(12, 4, dtype=torch.float64), keep, 0.1)
    assert counted["product"] == {"float64": 2 * 8 * 4 * 4}
    assert counted["factorisation"] == {"float64": pytest.approx(8**3 / 3 + 2 * 8 * 8 * 4)}


def test_a_ranking_reads_its_scores_to_the_host_once():
    assert _counted(top_k_indices, torch.randn(30), 4) == {"host_reads": {"count": 1}}
    assert _counted(balanced_top_k, torch.randn(30), 7, 3) == {"host_reads": {"count": 1}}


def test_phases_nest_as_the_timers_do_and_nothing_is_counted_outside():
    context = MethodContext(batches=[])
    flops.record(1e9, "float32")  # no phase open: the ops cost the same outside a compression, uncounted
    with context.timer("apply"):
        flops.record(10, "float32")
        with context.timer("solve"):
            flops.record(5, "float64", "factorisation")
            with context.timer("solve"):  # re-entered: counted once
                flops.record(1, "float64", "factorisation")
    assert context.arithmetic.flops("apply") == 16
    assert context.arithmetic.flops("solve") == 6
    other = MethodContext(batches=[])
    with context.timer("apply"), other.timer("selection"):  # a context run inside another's phase: both count
        flops.record(7, "bfloat16")
    assert context.arithmetic.flops("apply") == 23 and other.arithmetic.flops("selection") == 7


def test_dense_forward_unit():
    """2 × weights × tokens plus the two token-pair products of attention, 4·seqlen·(H·d_h) per token and layer."""
    assert flops.dense_forward_flops(1000, 64, 16, 2, 8) == 2 * 1000 * 64 + 4 * 64 * 16 * 8 * 2


def test_a_compression_reports_its_arithmetic_per_phase_against_hand_counts():
    """FlattenGPT's defaults on a tiny LLaMA (hidden 64, MLP 96, 3 layers, 2 heads of 32 / 1 KV, one pair merged):
    the covariance phase holds the wide MLP's second moment (2·N·(2i)²) and the cross moment with its target
    (2·N·(2i)·d); the head scoring the o_proj input's moment (2·N·(2·H·d_h)²) and its cross moment (2·N·(2·H·d_h)·d),
    N the real calibration tokens. The report's unit is one dense forward of the original stack."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layer_weights = sum(p.numel() for p in model.model.layers.parameters())
    cal = {"nsamples": 4, "seqlen": 32, "batch_size": 2}
    quantizer = FlattenQuantizer(
        FlattenConfig(method="flattengpt", num_layers_to_remove=1, dataset=tiny_models.sample_texts(200), **cal),
        progress=False,
    )
    quantizer.compress(model, tiny_models.CharTokenizer())
    n = quantizer.report["calibration"]["tokens"]
    assert n == 4 * 32  # packed: every position is a real token
    arithmetic = quantizer.report["cost"]["arithmetic"]
    phases = arithmetic["phases"]
    w, h, d = 2 * 96, 2 * 2 * 32, 64
    # float32 statistics of float32 activations: the second moments and the centred cross moments with the targets
    assert phases["covariance"]["product"] == {"float32": 2 * n * w * w + 2 * n * w * d}
    assert phases["head_scoring"]["product"] == {"float32": 2 * n * h * h + 2 * n * h * d}
    unit = 2 * layer_weights * n + 4 * n * 32 * (2 * 32) * 3
    assert arithmetic["dense_forward_flops"] == unit
    assert phases["covariance"]["dense_forwards"] == pytest.approx((2 * n * w * w + 2 * n * w * d) / unit, abs=1e-4)

    # Everything the phases count is inside plan or apply: the total is theirs.
    def flops_of(phase: str) -> float:
        kinds = phases.get(phase, {})
        return sum(sum(v.values()) for k, v in kinds.items() if k not in ("dense_forwards", "host_reads"))

    assert arithmetic["flops"] == pytest.approx(flops_of("plan") + flops_of("apply"))
    inner = ("head_scoring", "attention_solve", "covariance", "solve")
    assert phases["apply"]["dense_forwards"] == pytest.approx(sum(phases[p]["dense_forwards"] for p in inner), abs=1e-3)
