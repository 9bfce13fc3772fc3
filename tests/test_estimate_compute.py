"""`optimum-flatten estimate`'s compute model against what a compression counts, and its predicted seconds against
the H100 measurements of issue 31.

- The arithmetic an estimate states per phase (`CompressionMethod.compute`, from shapes alone) equals what the ops
  record while a real compression of a tiny LLaMA runs (`report["cost"]["arithmetic"]`), kind by kind and precision
  by precision: the estimate's formulas and the ops' counts are two writings of one count, so neither can drift.
- The stack passes it splits by phase add up to the memory model's total (which tests/test_estimate.py holds
  equal to the measured passes).
- The roofline (`optimum_flatten.roofline`) turns them into seconds on an H100: each row of the issue's table within
  25% in all and phase by phase, with the efficiencies stated in `roofline`, none of them set per row.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import tiny_models
from common import write_llama2_7b_config
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.cli.main import main
from optimum_flatten.compression.compute import Tally
from optimum_flatten.compression.workspace import WorkspaceSizes
from optimum_flatten.estimate import estimate_checkpoint, estimate_memory
from optimum_flatten.methods.flattengpt import compute as flattengpt_compute
from optimum_flatten.methods.flattengpt.compute import flattengpt_arithmetic
from optimum_flatten.registry import get_method_class
from optimum_flatten.roofline import DEVICES, HOST_READ_SECONDS, device_from_options
from optimum_flatten.utils import flops

CALIBRATION = {"nsamples": 4, "seqlen": 32, "batch_size": 2}


def _llama(layers: int = 3, heads: int = 2, kv_heads: int = 1) -> Any:
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _counted(model: Any, method: str, args: dict[str, Any]) -> dict[str, Any]:
    config = FlattenConfig(
        method=method, num_layers_to_remove=1, dataset=tiny_models.sample_texts(200), method_args=args, **CALIBRATION
    )
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer())
    assert quantizer.report["calibration"]["tokens"] == 4 * 32  # packed: the estimate's N
    return quantizer.report["cost"]["arithmetic"]["phases"]


def _without_zeros(kinds: dict[str, Any]) -> dict[str, float]:
    """``{"kind precision": value}`` of a phase, zeros and the report's unit left out."""
    return {
        f"{kind} {p}": v for kind, values in kinds.items() if kind != "dense_forwards" for p, v in values.items() if v
    }


FLATTENGPT_OPTIONS = [
    {},  # the defaults: KV groups by reconstruction (exhaustive here) towards the sequential targets
    {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"},  # the paper's
    {"attention_target": "parallel", "mlp_target": "parallel"},  # reconstruction towards the wide block's output
    {"covariance_dtype": "float64"},
    {"covariance_dtype": "tf32"},
    {"covariance_dtype": "bfloat16"},  # split bfloat16 products: twice the flops, on bfloat16 tensor cores
]


@pytest.mark.parametrize("options", FLATTENGPT_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_flattengpt_estimated_arithmetic_is_what_the_ops_count(options):
    """Every phase, kind and precision equal. The float32 path's re-scoring near the cut is a bound in the estimate
    (how many channels lie within rounding of the cut is known only at run time); counted at what the run re-scored,
    the solve is exact too, and the bound is never below it."""
    model = _llama()
    estimate = estimate_memory(model, "flattengpt", 1, method_args=options, **CALIBRATION)
    z = WorkspaceSizes(estimate.model, estimate.calibration)
    config = get_method_class("flattengpt").config_class(**options)
    counted = _counted(model, "flattengpt", options)
    refined = 0
    if options.get("covariance_dtype") != "float64":
        # Each channel re-scored costs four float64 products with C (8·w² flops, w = 2·96): how many the run
        # re-scored, read off its count; the float32 solves of the same refinement must then agree too.
        unrefined = flattengpt_arithmetic(z, 1, config, refined_channels=0)["solve"]["product"]["float64"]
        refined = (counted["solve"]["product"]["float64"] - unrefined) / (8 * 192**2)
        assert refined == int(refined) and 0 <= refined <= 64
    exact = flattengpt_arithmetic(z, 1, config, refined_channels=int(refined))
    for phase, kinds in exact.items():
        assert _without_zeros(kinds) == pytest.approx(_without_zeros(counted[phase])), phase
    for phase in ("head_scoring", "attention_solve", "covariance", "selection", "propagate", "flatten"):
        assert not _without_zeros(counted.get(phase, {})) or phase in exact, phase
    bound = estimate.compute.arithmetic["solve"]
    for kind in ("product", "factorisation"):
        assert sum(bound.get(kind, {}).values()) >= sum(exact["solve"].get(kind, {}).values())


@pytest.mark.parametrize("options", [{}, {"estimator": "lstsq_gain"}], ids=["lstsq", "lstsq_gain"])
def test_replaceme_estimated_normal_equations_are_what_the_fit_counts(options):
    """ReplaceMe's fit as its normal equations: MᵀM and Mᵀ(L − Y) over N tokens (2·N·d² each), the factor (d³/3),
    its solve (2·d³; twice the columns with the gain) and the fold into the down projection (2·d²·i)."""
    model = _llama()
    estimate = estimate_memory(model, "replaceme", 1, method_args=options, **CALIBRATION)
    counted = _counted(model, "replaceme", options)
    fit = estimate.compute.arithmetic["linear_replacement"]
    assert _without_zeros(fit) == pytest.approx(_without_zeros(counted["linear_replacement"]))
    n, d, i = 4 * 32, 64, 96
    grams = 3 if options else 2
    assert fit["product"]["float64"] == grams * 2 * n * d * d + 2 * d * d * i
    assert fit["factorisation"]["float64"] == pytest.approx(d**3 / 3 + 2 * d * d * (2 * d if options else d))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"},
        {"attention_target": "parallel"},
        {"similarity_memory_gb": 64.0},  # the band holds every layer: the selection's cache, no propagation
        {"calibration_mode": "sequential", "mlp_target": "parallel"},
        {"max_group_size": 3},
        {"selection": "wide_loss"},
    ],
)
def test_flattengpt_phase_passes_add_up_to_the_memory_models_total(options, tmp_path):
    """At LLaMA-2-7B's shape (config.json only): the per-phase split is the total it was split from."""
    write_llama2_7b_config(tmp_path)
    estimate = estimate_checkpoint(str(tmp_path), "flattengpt", 7, dtype="bfloat16", method_args=options)
    assert sum(estimate.compute.phase_passes.values()) == pytest.approx(estimate.stack_passes, abs=1e-3)


#: Issue 31's table: one H100 (SXM5, 80 GB HBM3), random bf16 weights, 128 × 2048 calibration tokens in batches of
#: 8; (label, config overrides, method, layers removed, options, measured compress seconds, measured phase seconds).
H100_ROWS = [
    (
        "flattengpt defaults",
        {},
        "flattengpt",
        7,
        {"covariance_dtype": "float32"},  # the defaults then: float32 moments (before "auto")
        93.8,
        {"covariance": 42.5, "attention_solve": 19.3, "head_scoring": 12.3, "selection": 8.1, "solve": 6.0,
         "propagate": 4.3},
    ),
    (
        "flattengpt tf32",
        {},
        "flattengpt",
        7,
        {"covariance_dtype": "tf32"},
        63.2,
        {"attention_solve": 19.1, "covariance": 16.9, "head_scoring": 8.6, "selection": 8.1},
    ),
    # Measured when ReplaceMe's fit walked the stack a second time (no one-pass walk): `fit_shortlist=0` is it.
    (
        "replaceme defaults",
        {},
        "replaceme",
        7,
        {"fit_shortlist": 0},
        22.5,
        {"linear_replacement": 14.2, "selection": 8.0},
    ),
    (
        "flattengpt 70B widths, 4 layers",
        {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 4, "num_attention_heads": 64,
         "num_key_value_heads": 8},
        "flattengpt",
        1,
        {"covariance_dtype": "float32"},
        57.6,
        {"covariance": 38.0, "solve": 6.4, "head_scoring": 5.9},
    ),
]  # fmt: skip


def _former_ranking_seconds(method: str, removed: int, config: dict) -> float:
    """What the rows' code spent that today's does not: they were measured when FlattenGPT's channel ranking read its
    scores one `float()` (one device sync) at a time, one per channel of each merged pair's concatenated MLP; today
    one copy reads them all (`ops.selection.host_scores`). Added back at the model's price of a read, so the rest of
    the prediction is still checked against what was measured."""
    if method != "flattengpt":
        return 0.0
    pairs, width = removed, 2 * config["intermediate_size"]  # the defaults merge pairs: one per removed layer
    return pairs * (width - 1) * HOST_READ_SECONDS


def _former_greedy_elimination(tally: Tally, total: int, kv: int, c: int, d: int) -> None:
    """The KV-group search the rows were measured with, as its compute model stood then: a new factorisation and
    inverse of the kept channels every step, and every removal scored alone (34 kernels and 7 host reads a group,
    3 more reads a step). Today's search (`ops.block_elimination`) downdates one factorisation and scores a chunk of
    groups at once; its prediction is not yet checked on a GPU."""
    for kept in range(total, kv, -1):
        k = kept * c
        tally.cholesky(k)
        tally.add(flops.cholesky_inverse(k), "float64", "factorisation")
        tally.add(2 * flops.product(k, k, d), "float64")
        tally.reads(3)
        per_group = 3 * flops.product(c, c, d) + flops.product(c, k, c) + flops.product(c, c, c)
        tally.add(kept * per_group, "float64")
        tally.add(kept * flops.cholesky_solve(c, d), "float64", "factorisation")
        for _ in range(kept):
            tally.cholesky(c)
        tally.reads(5 * kept)
        tally.launches(34 * kept)


@pytest.mark.parametrize("row", H100_ROWS, ids=[row[0] for row in H100_ROWS])
def test_predicted_seconds_on_an_h100_are_within_a_quarter_of_the_measured(row, tmp_path, monkeypatch):
    """Predicted from config.json alone with the H100 preset; the phases the issue lists and the whole compression
    (the phases' sum: the rest, capture and export, is under a second) within 25%. The check can fail: without the
    arithmetic (stack passes alone, as before issue 31) FlattenGPT's defaults predict a third of the time."""
    label, overrides, method, removed, options, total, phases = row
    write_llama2_7b_config(tmp_path, **overrides)
    arguments = (str(tmp_path), method, removed)
    today = estimate_checkpoint(*arguments, dtype="bfloat16", method_args=options, device=DEVICES["h100"])
    monkeypatch.setattr(flattengpt_compute, "_greedy_elimination", _former_greedy_elimination)
    estimate = estimate_checkpoint(*arguments, dtype="bfloat16", method_args=options, device=DEVICES["h100"])
    prediction = estimate.prediction
    former = _former_ranking_seconds(method, removed, json.loads((tmp_path / "config.json").read_text()))
    assert prediction.total_seconds + former == pytest.approx(total, rel=0.25), label
    if "attention_solve" in prediction.phases:  # today's search does less of the same work
        assert today.prediction.phases["attention_solve"]["seconds"] < prediction.phases["attention_solve"]["seconds"]
    for name, measured in phases.items():
        predicted = prediction.phases[name]["seconds"] + (former if name == "solve" else 0.0)
        assert predicted == pytest.approx(measured, rel=0.25), (label, name)
    passes_only = sum(p["passes_seconds"] for p in prediction.phases.values())
    if label == "flattengpt defaults":
        assert passes_only < 0.4 * total


#: The rows of the device calls of 2026-11-27 (`benchmarks/cost/gpu_session.py` on an H100): the float32 and tf32 rows
#: from the first call (the downdated KV-group search, scores read at once); both ReplaceMe rows and the 70B row from a
#: later session's call A (code of b261fdf: the KV search's removals as a product and a sum, the cached sequential
#: targets, ReplaceMe's held states; covariance_dtype="auto", which at 70B widths takes the split products for the heads
#: and float32 for the 57,344-wide MLP); the defaults row from its call C (the split moments' lower block triangle,
#: their parts written in place into one stacked buffer). The first call's bfloat16 row measured the split products
#: before that change, which the model no longer describes: it stays in the notebook, not here. (result file, config
#: overrides, method, layers removed, options). Each is predicted from config.json alone and checked against its JSON.
H100_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H100_ROWS_TODAY = [
    ("cost_gpu_llama-2-7b_defaults", {}, "flattengpt", 7, {}),
    ("cost_gpu_llama-2-7b_float32", {}, "flattengpt", 7, {"covariance_dtype": "float32"}),
    ("cost_gpu_llama-2-7b_tf32", {}, "flattengpt", 7, {"covariance_dtype": "tf32"}),
    # The streamed fit's second walk, measured before the one-pass walk (`fit_shortlist=0` is that path today); the
    # next device call's `replaceme` row measures the one-pass default, and this entry becomes ``{}`` with it.
    ("cost_gpu_llama-2-7b_replaceme", {}, "replaceme", 7, {"fit_shortlist": 0}),
    ("cost_gpu_llama-2-7b_replaceme_held", {}, "replaceme", 7, {"held_states_gb": 24}),
    (
        "cost_gpu_llama-2-70b_4_layers",
        {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 4, "num_attention_heads": 64,
         "num_key_value_heads": 8},
        "flattengpt",
        1,
        {},
    ),
]  # fmt: skip
#: Phases the model is known to miss at LLaMA-2-7B widths on an H100 (measured / predicted), from the profile of
#: 2026-11-27 (`benchmarks/results/profile_gpu_llama-2-7b_8_layers_flattengpt.json`): the KV-group search's batched
#: float64 products over 16 groups of 128 channels ran at about 4% of the FP64 peak (0.40 s a pair for 0.96 TFLOP),
#: where the model counts 75%; the MLP solve's float32 panel products and triangular solves filled the launch queue
#: (0.64 s a pair against 0.34). Strict: the day the model (or the code) closes a gap, this list must shrink. The
#: defaults' total was within the quarter on call A (33.5 s predicted against 43.3), just outside it on
#: call B (32.1 against 42.9: the split moments' products shrank by a fifth, the model's count with them, but the
#: model counts products, not the float64 adds and copies around them, 1.7 of the covariance phase's 3.6 s in that
#: call's profile of 8 layers) and within it again on call C (32.1 against 41.2, once the split's parts were
#: written in place); attention_solve (2.7 s against 4.2) and solve (2.4 against 4.1) are still under-predicted.
H100_KNOWN_GAPS = {
    ("cost_gpu_llama-2-7b_defaults", "attention_solve"),
    ("cost_gpu_llama-2-7b_defaults", "solve"),
    ("cost_gpu_llama-2-7b_float32", "attention_solve"),
    ("cost_gpu_llama-2-7b_float32", "solve"),
    ("cost_gpu_llama-2-7b_tf32", "attention_solve"),
    ("cost_gpu_llama-2-7b_tf32", "solve"),
}


#: The rows of the device call of 2026-11-28 on an NVIDIA H200 (`gpu_session.py` on the code of 74863e5, every row of
#: the H100 table but the float32 and tf32 ones, which "auto" replaced as the default): the same chip's arithmetic
#: with faster memory, so the same model with the H200's bandwidth must predict them as it predicts the H100's.
H200_ROWS = [(f"{row[0]}_h200", *row[1:]) for row in H100_ROWS_TODAY if not row[0].endswith(("float32", "tf32"))]
#: The call of 2026-11-30 on an H200 (code of ccd70be) measured ReplaceMe's one-walk default, which the row of that name
#: now holds (so predicted with the default options); the streamed row it replaced keeps its file and its options.
H200_ROWS = [
    (name, *rest) if name != "cost_gpu_llama-2-7b_replaceme_h200" else (name, rest[0], rest[1], rest[2], {})
    for name, *rest in H200_ROWS
] + [("cost_gpu_llama-2-7b_replaceme_h200_before_one_walk", {}, "replaceme", 7, {"fit_shortlist": 0})]
#: The H100's known gaps as they stand on the H200 (measured / predicted s): attention solve 3.97 / 2.72, solve 3.88 /
#: 2.38; the same launch-bound panels and float64 products, so the same strict expected failures.
H200_KNOWN_GAPS = {(f"{name}_h200", phase) for name, phase in H100_KNOWN_GAPS if "defaults" in name}


def _checks(rows: list, gaps: set, device: str) -> list:
    """(row, phase, device) of every row of a device's table, the known gaps marked strict xfail."""
    params = []
    for row in rows:
        measured = json.loads((H100_RESULTS / f"{row[0]}.json").read_text())["timings_seconds"]
        # The phases the model names (capture and export preparation it leaves out: a second or two at most).
        modelled = ("selection", "propagate", "head_scoring", "attention_solve", "covariance", "solve")
        phases = [k for k, v in measured.items() if v >= 1.0 and k in (*modelled, "linear_replacement")]
        phases.append("total")
        for phase in phases:
            gap = (row[0], phase) in gaps
            marks = [pytest.mark.xfail(strict=True, reason="known gap of the model")] if gap else []
            name = f"{row[0].removeprefix('cost_gpu_')}-{phase}"
            params.append(pytest.param(row, phase, device, marks=marks, id=name))
    return params


@pytest.mark.parametrize(
    ("row", "phase", "device"),
    _checks(H100_ROWS_TODAY, H100_KNOWN_GAPS, "h100") + _checks(H200_ROWS, H200_KNOWN_GAPS, "h200"),
)
def test_predicted_phases_on_a_device_match_its_rows_of_today(row, phase, device, tmp_path):
    """Every phase of a second or more, and the whole compression, within 25% of today's rows on the device that ran
    them (an H100, and an H200 the next day). A phase whose stack passes the model gives as a bound (ReplaceMe's fit:
    where the removed block lies) is predicted with the passes the row reports instead (its plan is known once
    measured); the arithmetic is the model's either way."""
    name, overrides, method, removed, options = row
    measured = json.loads((H100_RESULTS / f"{name}.json").read_text())
    assert device in measured["device"].lower(), (device, measured["device"])  # the row was measured on that device
    write_llama2_7b_config(tmp_path, **overrides)
    estimate = estimate_checkpoint(str(tmp_path), method, removed, dtype="bfloat16", method_args=options,
                                   device=DEVICES[device])  # fmt: skip
    phases = {k: dict(v) for k, v in estimate.prediction.phases.items()}
    if estimate.stack_passes_is_bound and method == "replaceme":
        modelled = estimate.compute.phase_passes["linear_replacement"]
        realised = measured["stack_passes"] - estimate.compute.phase_passes["selection"]
        fit = phases["linear_replacement"]
        fit["seconds"] = fit["arithmetic_seconds"] + fit["passes_seconds"] * realised / modelled
    if phase == "total":
        predicted, actual = sum(v["seconds"] for v in phases.values()), measured["compress_seconds"]
    else:
        predicted, actual = phases[phase]["seconds"], measured["timings_seconds"][phase]
    assert predicted == pytest.approx(actual, rel=0.25), (name, phase, predicted, actual)


def test_cli_estimate_on_a_device(tmp_path, capsys):
    write_llama2_7b_config(tmp_path)
    argv = ["estimate", str(tmp_path), "--num-layers-to-remove", "7", "--dtype", "bfloat16"]
    assert main([*argv, "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "predicted on h100:" in text and "arithmetic (dense forwards)" in text
    assert main([*argv, "--peak-tflops", "989.4", "--bandwidth-gbs", "3350", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prediction"]["device"] == "custom"
    assert result["prediction"]["peak_tflops"]["float32"] == 989.4  # one number for every precision
    covariance = result["compute"]["arithmetic"]["covariance"]["product"]
    # covariance_dtype="auto" on a bfloat16 model: the split products (the moment's lower block triangle over three
    # times the tokens, in bands of 2,048 columns; three times the cross's products)
    tokens, width = 128 * 2048, 2 * 11008
    lower = sum(2 * (width - a) * 3 * tokens * min(2048, width - a) for a in range(0, width, 2048))
    assert lower < 0.55 * 3 * 2 * tokens * width**2
    assert covariance["bfloat16"] == 7 * (lower + 3 * 2 * tokens * width * 4096)
    assert "float32" not in covariance and "float64" not in covariance
    assert main([*argv, "--device", "h100", "--peak-tflops", "float32=30"]) == 0
    assert "predicted on h100 (figures given)" in capsys.readouterr().out


def test_device_options_are_refused_with_what_is_allowed():
    assert device_from_options(None, None, None) is None
    assert device_from_options("a100", None, None).peak("float16") == 312e12
    with pytest.raises(ValueError, match="needs both --peak-tflops and --bandwidth-gbs"):
        device_from_options(None, "100", None)
    with pytest.raises(ValueError, match="precisions among"):
        device_from_options(None, "fp8=100", 1000.0)
    with pytest.raises(ValueError, match="positive TFLOPS"):
        device_from_options("h100", "float32=-1", None)
    # inf predicted 0 s for every phase
    with pytest.raises(ValueError, match="positive TFLOPS, a finite number"):
        device_from_options(None, "inf", "3350")
    with pytest.raises(ValueError, match="bandwidth-gbs must be positive, a finite number"):
        device_from_options("h100", None, "inf")


@pytest.mark.parametrize(
    "argv",
    [["--peak-tflops", "lots", "--bandwidth-gbs", "10"], ["--device", "h100", "--bandwidth-gbs", "0"]],
    ids=["peak", "bandwidth"],
)
def test_device_argument_errors_import_neither_torch_nor_transformers(argv, tmp_path):
    argv = ["estimate", str(tmp_path / "model"), "--num-layers-to-remove", "2", *argv]
    code = (
        "import sys\nfrom optimum_flatten.cli.main import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as exit_:\n    code = exit_.code\n"
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False", "False"], result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    "argv",
    [["--nsamples", "0"], ["--seqlen", "-3"], ["--batch-size", "0"], ["--num-layers-to-remove", "0"]],
    ids=["nsamples", "seqlen", "batch", "depth"],
)
def test_sizes_out_of_range_are_refused_before_torch_loads(argv, tmp_path):
    """As compress refuses them: in a fraction of a second, not after torch and the meta model (6-13 s)."""
    argv = ["estimate", str(tmp_path / "model"), "--num-layers-to-remove", "2", *argv]
    code = (
        "import sys\nfrom optimum_flatten.cli.main import main\n"
        f"code = main({argv!r})\nprint(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "error:" in result.stderr
