"""Speed measurement protocol: synchronised timed regions, interleaving, and the verdict on a speed-up.

Speeds themselves are never asserted (machines differ); what is tested is when the clock is read, in which
order models run, and what is printed for given timings.
"""

import types

import pytest
import torch

import tiny_models
from optimum_flatten.evaluation import speed
from optimum_flatten.evaluation.speed import (
    SpeedComparison,
    compare_decode,
    compare_prefill,
    interleaved_seconds,
    median_seconds,
    prefill_tokens_per_second,
    relative_spread,
    speed_verdict,
    time_once,
)
from optimum_flatten.utils import torch_utils
from optimum_flatten.utils.torch_utils import resolve_device, synchronize


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.synchronize replaced by a recorder, as if a CUDA device were present."""
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_synchronize_waits_for_cuda_only(fake_cuda, monkeypatch):
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert fake_cuda == []
    synchronize("cuda:0")
    assert fake_cuda == [torch.device("cuda:0")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    synchronize(None)  # a phase timer that does not know the device must not initialise CUDA
    assert len(fake_cuda) == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    synchronize(None)
    assert len(fake_cuda) == 2


def test_timed_region_synchronises_before_start_and_before_stop(fake_cuda, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    clock = iter(range(100))
    monkeypatch.setattr(
        speed, "time", types.SimpleNamespace(perf_counter=lambda: events.append("clock") or next(clock))
    )

    median = median_seconds(lambda: events.append("run"), repeats=2, warmup=1, device=torch.device("cuda"))
    timed = ["sync cuda", "clock", "run", "sync cuda", "clock"]
    assert events == ["run", *timed, *timed]  # the warm-up is not timed; every timed run is fenced on both sides
    assert median == 1

    events.clear()
    time_once(lambda: events.append("run"), "cpu")
    assert events == ["clock", "run", "clock"]  # the CPU is timed as before


def test_prefill_is_timed_between_synchronisations_of_the_models_device(monkeypatch):
    model = tiny_models.tiny_llama_gqa()
    events: list[object] = []
    monkeypatch.setattr(speed, "synchronize", lambda device=None: events.append(("sync", device)))
    model.register_forward_hook(lambda *_: events.append("forward"))

    result = prefill_tokens_per_second(model, seqlen=8, repeats=3, warmup=1)
    sync = ("sync", torch.device("cpu"))
    assert events == ["forward"] + [sync, "forward", sync] * 3
    for key in ("tokens_per_second", "median_seconds", "seqlen", "batch_size", "repeats"):  # the old keys stay
        assert key in result
    assert result["dtype"] == "float32" and result["threads"] == torch.get_num_threads()
    assert result["device"] == "cpu" and result["device_name"] and len(result["seconds"]) == 3
    assert result["spread"] >= 0


def test_interleaving_alternates_after_warming_up_each_run():
    order: list[str] = []
    samples = interleaved_seconds([lambda: order.append("A"), lambda: order.append("B")], rounds=4, warmup=2)
    assert order == ["A", "A", "B", "B"] + ["A", "B"] * 4
    assert [len(s) for s in samples] == [4, 4]


def test_comparing_two_models_alternates_them_on_the_same_tokens():
    dense, small = tiny_models.tiny_llama_gqa(), tiny_models.tiny_llama_gqa(seed=1)
    order: list[str] = []
    inputs: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def hook(_module, _args, kwargs, _output) -> None:
            order.append(name)
            inputs.setdefault(name, kwargs["input_ids"])

        return hook

    for name, model in (("dense", dense), ("small", small)):
        model.register_forward_hook(recorder(name), with_kwargs=True)

    comparison = compare_prefill(dense, small, seqlen=8, rounds=3, warmup=1)
    assert order == ["dense", "small"] * 4
    assert torch.equal(inputs["dense"], inputs["small"])
    assert comparison.rounds == 3 and comparison.shape == {"batch_size": 1, "seqlen": 8}
    assert comparison.layers == (6, 6) and comparison.ideal == 1.0
    assert comparison.to_dict()["status"] in ("reported", "noisy", "beyond_ideal")

    order.clear()
    decode = compare_decode(dense, small, batch_size=2, prompt_length=4, new_tokens=3, rounds=2)
    firsts = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]  # one generate = several forwards
    assert firsts == ["dense", "small"] * 3
    assert decode.tokens == 6 and decode.side("candidate")["new_tokens"] == 3


def test_relative_spread_is_the_interquartile_range_over_the_median():
    assert relative_spread([1.0]) == 0.0
    assert relative_spread([2.0, 2.0, 2.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert relative_spread([1.0, 1.0, 1.0, 1.0, 100.0]) == 0.0  # one slow outlier does not make it noisy


def test_a_speedup_smaller_than_its_spread_is_not_reported():
    verdict = speed_verdict(1.05, 0.20, ideal=1.25)
    assert verdict.status == "noisy" and not verdict.reported
    assert verdict.cell() == "noisy, not reported" and "1.05" not in verdict.cell()
    assert "noisy, not reported" in verdict.message
    assert speed_verdict(0.90, 0.15).status == "noisy"  # slower, but within the noise


def test_a_plausible_speedup_is_reported():
    verdict = speed_verdict(1.20, 0.03, ideal=30 / 24)
    assert verdict.status == "reported" and verdict.cell() == "1.200"
    assert speed_verdict(0.80, 0.05, ideal=1.25).status == "reported"  # slower is reported as measured
    bound = 1.25 * 1.04
    assert speed_verdict(bound, 0.04, ideal=1.25).status == "reported"  # up to L/L' x (1 + spread) inclusive


def test_a_speedup_beyond_the_ideal_is_warned():
    verdict = speed_verdict(1.60, 0.05, ideal=30 / 24)
    assert verdict.status == "beyond_ideal" and verdict.reported
    assert verdict.cell() == "1.600 (!)"
    assert verdict.message.startswith("warning:") and "1.250" in verdict.message
    assert speed_verdict(1.60, 0.05, ideal=None).status == "reported"  # no layer counts, no bound


ENVIRONMENT = {"device": "cuda:0", "device_name": "Fake GPU 80GB", "dtype": "bfloat16", "threads": 16}


def synthetic(baseline, candidate, layers=(30, 24)) -> SpeedComparison:
    return SpeedComparison(
        kind="prefill",
        baseline_seconds=tuple(baseline),
        candidate_seconds=tuple(candidate),
        tokens=2048,
        shape={"batch_size": 1, "seqlen": 2048},
        environment=ENVIRONMENT,
        layers=layers,
    )


def test_comparisons_on_synthetic_timings_print_value_spread_shapes_and_device():
    steady = synthetic([1.00, 1.02, 0.98, 1.01, 0.99], [0.84, 0.85, 0.83, 0.84, 0.84])
    assert steady.verdict.status == "reported" and 1.15 < steady.speedup < 1.22
    line = steady.describe()
    assert "\n" not in line
    for part in (
        "prefill speed-up 1.",
        "5 interleaved rounds",
        "spread",
        "30/24 = 1.250",
        "batch 1 x 2048 tokens",
        "Fake GPU 80GB (cuda:0)",
        "bfloat16",
        "16 threads",
    ):
        assert part in line, part
    assert steady.tokens_per_second("baseline") == pytest.approx(2048 / 1.00)

    # Load came and went: per-round ratios scatter wider than the effect.
    noisy = synthetic([1.0, 2.0, 1.0, 1.5, 1.0], [0.95, 1.0, 1.4, 1.6, 0.7])
    assert noisy.verdict.status == "noisy"
    assert "speed-up: noisy, not reported" in noisy.describe() and "Fake GPU" in noisy.describe()
    assert noisy.to_dict()["status"] == "noisy"

    # The dense runs were slowed by something else: more than removing 6 of 30 layers can give.
    beyond = synthetic([2.0, 2.1, 2.0, 2.05, 2.0], [1.0, 1.0, 1.01, 1.0, 1.0])
    assert beyond.verdict.status == "beyond_ideal"
    head, warning = beyond.describe().split("\n")
    assert "(!)" in head and warning.startswith("warning:")


def test_comparison_rejects_unpaired_timings():
    with pytest.raises(ValueError, match="same positive number of rounds"):
        synthetic([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):  # one round has no spread to judge its ratio by
        synthetic([1.0], [0.5])


def test_resolve_device_refuses_what_this_torch_cannot_use(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("banana")
    monkeypatch.setattr(torch_utils.torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


@pytest.mark.gpu
def test_synchronised_timing_on_cuda_matches_cuda_events():
    """Without synchronisation the host clock sees only the launches of this chain, far less than its work."""
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        b = a
        for _ in range(20):
            b = b @ a / 64
        return b

    work()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    stop.record()
    torch.cuda.synchronize()
    events_seconds = start.elapsed_time(stop) / 1000
    measured = median_seconds(work, repeats=3, warmup=1, device=torch.device("cuda"))
    assert measured == pytest.approx(events_seconds, rel=0.5)


@pytest.mark.gpu
def test_prefill_comparison_runs_on_cuda_and_names_the_gpu():
    dense = tiny_models.tiny_llama_gqa().cuda()
    small = tiny_models.tiny_llama_gqa(seed=1).cuda()
    comparison = compare_prefill(dense, small, seqlen=16, rounds=3)
    assert comparison.environment["device"].startswith("cuda")
    assert comparison.environment["device_name"] == torch.cuda.get_device_name(0)
