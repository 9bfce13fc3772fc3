"""What `evaluate` and `demo` print about speed: device, dtype, shapes and threads with every number, interleaved
comparisons with their spread, and no speed-up that the spread or the layer counts do not support."""

import json

import pytest
import torch

import tiny_models
from optimum_flatten import evaluation
from optimum_flatten.cli.main import main
from optimum_flatten.evaluation.speed import SpeedComparison, _cpu_name


@pytest.fixture
def tiny_dir(llama_on_disk):
    return llama_on_disk


def test_evaluate_against_a_baseline_interleaves_and_prints_the_context(tiny_dir, tmp_path, capsys):
    dense, data = tiny_dir
    out = tmp_path / "eval.json"
    common = ["evaluate", str(dense), "--baseline", str(dense), "--dataset", str(data), "--seqlen", "16"]
    code = main([*common, "--max-tokens", "64", "--no-fidelity", "--speed-rounds", "3", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "prefill tok/s (IQR)" in printed and "prefill ratio" in printed and "decode ratio" in printed
    lines = [line for line in printed.splitlines() if line.startswith(("prefill speed-up", "decode speed-up"))]
    assert len(lines) == 2
    for line in lines:
        assert "3 interleaved rounds" in line and "spread" in line and "ideal L/L' = 6/6 = 1.000" in line
        assert f"{_cpu_name()} (cpu), float32, {torch.get_num_threads()} threads" in line
    assert "batch 1 x 16 tokens, no cache" in printed and "batch 4, prompt 64, 32 generated tokens" in printed
    models = json.loads(out.read_text())["models"]
    comparison = models[1]["prefill_comparison"]
    assert comparison["rounds"] == 3 and comparison["status"] in ("reported", "noisy", "beyond_ideal")
    assert comparison["environment"]["dtype"] == "float32" and len(comparison["ratios"]) == 3
    assert models[0]["prefill"]["interleaved"] and models[1]["decode"]["repeats"] == 3


def test_evaluate_alone_prints_device_dtype_shapes_and_threads(tiny_dir, capsys):
    dense, data = tiny_dir
    args = ["evaluate", str(dense), "--dataset", str(data), "--seqlen", "16", "--max-tokens", "32"]
    assert main([*args, "--speed-rounds", "2", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"speed on {_cpu_name()} (cpu), float32, {torch.get_num_threads()} threads" in printed
    assert "prefill batch 1 x 16 tokens" in printed and "medians of 2 synchronised runs" in printed
    assert "prefill ratio" not in printed  # nothing to compare with


def test_evaluate_refuses_a_device_or_rounds_it_cannot_use_in_one_line(tiny_dir, capsys, monkeypatch):
    dense, data = tiny_dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["evaluate", str(dense), "--dataset", str(data), "--device", "cuda"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: device 'cuda': no CUDA device") and error.count("\n") == 1
    for rounds in ("0", "1"):  # one round has no spread: its speed-up could not be told from noise
        assert main(["evaluate", str(dense), "--dataset", str(data), "--speed-rounds", rounds]) == 2
        assert "--speed-rounds must be at least 2" in capsys.readouterr().err
    assert main(["evaluate", str(dense), "--dataset", str(data), "--speed-rounds", "1", "--no-speed"]) == 0


def _synthetic(candidate: list[float]) -> SpeedComparison:
    return SpeedComparison(
        kind="prefill",
        baseline_seconds=(1.0, 1.0, 1.0, 1.0, 1.0),
        candidate_seconds=tuple(candidate),
        tokens=16,
        shape={"batch_size": 1, "seqlen": 16},
        environment={"device": "cpu", "device_name": "Test CPU", "dtype": "float32", "threads": 2},
        layers=(6, 4),
    )


@pytest.fixture
def tiny_demo(monkeypatch):
    """The demo on a tiny model: the bundled SmolLM2 and speeches replaced by a tiny LLaMA and sample texts."""
    from optimum_flatten import bundled

    monkeypatch.setattr(
        bundled, "load_smollm2", lambda dtype: (tiny_models.tiny_llama_gqa().eval(), tiny_models.tiny_hf_tokenizer())
    )
    monkeypatch.setattr(bundled, "load_corpus", lambda name: tiny_models.sample_texts(30))
    args = ["demo", "--method", "shortgpt", "--num-layers-to-remove", "2", "--nsamples", "4", "--seqlen", "16"]
    return [*args, "--eval-seqlen", "16", "--eval-tokens", "64", "--no-progress"]


@pytest.mark.parametrize(
    ("candidate", "cell", "warned"),
    [
        ([0.70, 0.68, 0.71, 0.69, 0.70], "1.429", False),  # 6 -> 4 layers: ideal 1.5
        ([0.95, 1.30, 0.70, 1.10, 0.80], "noisy, not reported", False),
        ([0.40, 0.41, 0.40, 0.40, 0.39], "2.500 (!)", True),
    ],
)
def test_demo_prints_the_speedup_only_when_the_spread_and_the_layers_support_it(
    tiny_demo, monkeypatch, capsys, candidate, cell, warned
):
    seen = {}

    def fake_compare(dense, compressed, seqlen, rounds):
        seen.update(layers=(dense.config.num_hidden_layers, compressed.config.num_hidden_layers), rounds=rounds)
        return _synthetic(candidate)

    monkeypatch.setattr(evaluation, "compare_prefill", fake_compare)
    assert main([*tiny_demo, "--speed-rounds", "5"]) == 0
    printed = capsys.readouterr().out
    assert seen == {"layers": (6, 4), "rounds": 5}  # the dense copy is timed against the compressed model
    row = next(line for line in printed.splitlines() if line.startswith("prefill tokens/s"))
    assert row.rstrip().endswith(cell)
    assert "Test CPU (cpu), float32, 2 threads" in printed and "batch 1 x 16 tokens" in printed
    assert ("warning: the measured speed-up 2.500 exceeds the ideal L/L' = 1.500" in printed) == warned


def test_demo_times_dense_and_compressed_alternately(tiny_demo, capsys):
    assert main([*tiny_demo, "--speed-rounds", "2"]) == 0
    printed = capsys.readouterr().out
    assert "prefill speed-up" in printed and "2 interleaved rounds after 1 warm-up" in printed
    assert "ideal L/L' = 6/4 = 1.500" in printed and f"{_cpu_name()} (cpu), float32" in printed


def test_demo_prints_and_saves_fidelity_to_the_dense_model(tiny_demo, capsys, tmp_path):
    import json

    out = tmp_path / "demo-out"
    assert main([*tiny_demo, "--speed-rounds", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    kl_row = next(line for line in printed.splitlines() if line.startswith("KL to dense"))
    top1_row = next(line for line in printed.splitlines() if line.startswith("top-1 agreement with dense"))
    report = json.loads((out / "flatten_report.json").read_text())
    saved = report["evaluation"]["fidelity"]
    assert f"{saved['kl']:.4f}" in kl_row and f"{saved['top1_agreement']:.3f}" in top1_row
    assert saved["kl"] > 0 and 0 <= saved["top1_agreement"] < 1  # two layers of a random model are gone
    # The compressed perplexity printed is the one the fidelity pass scored on the same windows.
    assert report["evaluation"]["compressed"]["perplexity"] == pytest.approx(saved["compressed_perplexity"])
    card = (out / "README.md").read_text()
    assert f"top-1 next-token agreement {saved['top1_agreement']:.3f}" in card


def test_demo_refuses_too_little_calibration_text_before_measuring_the_dense_model(tiny_demo, monkeypatch, capsys):
    """It used to measure the dense model first (a minute on SmolLM2), then refuse with advice to use `compress`
    for options the demo takes itself."""
    import optimum_flatten.cli.demo as demo

    monkeypatch.setattr(demo, "_size", lambda *a: pytest.fail("measured the dense model before refusing"))
    monkeypatch.setattr("optimum_flatten.evaluation.perplexity", lambda *a, **k: pytest.fail("measured"))
    argv = [*tiny_demo]
    argv[argv.index("--seqlen") + 1] = "100000"
    assert main(argv) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "fewer than nsamples x seqlen" in error[0] and "the demo runs" not in error[0]
