"""Inference speed: synchronised timings, medians with their spread, and interleaved two-model comparisons.

Why each piece is here:

- Accelerators run asynchronously, so a host clock around a forward measures kernel launches, not work. Every
  timed region synchronises the device before it starts and before it stops (`utils.torch_utils.synchronize`; a
  no-op on the CPU).
- One number hides how noisy it is. Every measurement keeps its samples and reports the median with a spread (the
  interquartile range relative to the median).
- Two models timed one after the other see different machine load. `compare_prefill` / `compare_decode` alternate
  them (A, B, A, B, ...) so load hits both, and compare them round by round (the speed-up is the median of the
  per-round ratios). `speed_verdict` then refuses to report a speed-up smaller than its spread and warns about one
  beyond what depth can explain (L/L' times one plus the spread: embeddings and the LM head do not shrink).
- Every result carries the device (its name), dtype, shapes and threads, since a speed without them means nothing.

Speed is never asserted in tests; only the protocol is.
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..utils.torch_utils import input_device, model_dtype, synchronize

Device = torch.device | str | None


def time_once(run: Callable[[], object], device: Device = None) -> float:
    """Seconds one call of `run` takes, with `device` synchronised before the clock starts and before it stops."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def sample_seconds(run: Callable[[], object], repeats: int, warmup: int, device: Device = None) -> list[float]:
    """Wall times of `repeats` synchronised calls of `run` after `warmup` untimed ones (caches, autotuning)."""
    for _ in range(warmup):
        run()
    return [time_once(run, device) for _ in range(repeats)]


def median_seconds(run: Callable[[], object], repeats: int, warmup: int, device: Device = None) -> float:
    """Median wall time of `run` over `repeats` synchronised calls after `warmup` untimed ones."""
    return statistics.median(sample_seconds(run, repeats, warmup, device))


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two values): how far a median can be trusted.

    Robust to the one slow outlier a loaded machine produces, unlike the standard deviation.
    """
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: Device) -> str:
    """A human name for a device: the GPU's marketing name, or the CPU model."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return torch.xpu.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({_cpu_name()})"
    return _cpu_name()


def speed_environment(model: nn.Module) -> dict[str, Any]:
    """Device (type and name), dtype and CPU threads a model is timed with: the context every speed needs."""
    device = input_device(model)
    return {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }


def describe_environment(environment: dict[str, Any]) -> str:
    """One line, e.g. ``NVIDIA H100 80GB HBM3 (cuda:0), bfloat16, 16 threads``."""
    text = f"{environment['device_name']} ({environment['device']}), {environment['dtype']}, "
    text += f"{environment['threads']} threads"
    if "baseline" in environment:
        text += f"; baseline on {describe_environment(environment['baseline'])}"
    return text


def _random_ids(model: nn.Module, shape: tuple[int, int], seed: int, vocab_size: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    vocab = vocab_size or model.config.vocab_size
    return torch.randint(3, vocab, shape, generator=generator).to(input_device(model))


def _prefill_run(model: nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    model.eval()
    return lambda: model(input_ids=ids, use_cache=False)


def _decode_run(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> Callable[[], object]:
    model.eval()
    kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True)
    kwargs["pad_token_id"] = getattr(model.config, "pad_token_id", None) or 0
    mask = torch.ones_like(ids)
    return lambda: model.generate(ids, attention_mask=mask, **kwargs)


@torch.no_grad()
def prefill_tokens_per_second(
    model: nn.Module, seqlen: int = 256, batch_size: int = 1, repeats: int = 5, warmup: int = 1, seed: int = 0
) -> dict[str, Any]:
    """Median prefill throughput (tokens/s) of a forward over random tokens of a fixed shape, no cache.

    Besides the median it returns the spread and the environment (device, dtype, threads) the number belongs to.
    To compare two models use `compare_prefill`, which interleaves them.
    """
    run = _prefill_run(model, _random_ids(model, (batch_size, seqlen), seed))
    return _throughput(model, run, batch_size * seqlen, {"seqlen": seqlen, "batch_size": batch_size}, repeats, warmup)


@torch.no_grad()
def decode_tokens_per_second(
    model: nn.Module,
    batch_size: int = 4,
    prompt_length: int = 64,
    new_tokens: int = 32,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Median greedy-decoding throughput (generated tokens/s over the whole batch), KV cache on, fixed length.

    Returns the spread and environment as `prefill_tokens_per_second` does; `compare_decode` compares two models.
    """
    run = _decode_run(model, _random_ids(model, (batch_size, prompt_length), seed), new_tokens)
    shape = {"batch_size": batch_size, "prompt_length": prompt_length, "new_tokens": new_tokens}
    return _throughput(model, run, batch_size * new_tokens, shape, repeats, 1)


def _throughput(
    model: nn.Module, run: Callable[[], object], tokens: int, shape: dict[str, int], repeats: int, warmup: int
) -> dict[str, Any]:
    """The one measurement behind `prefill_tokens_per_second` and `decode_tokens_per_second`: they differ only in
    what one run does and how many tokens it yields, so the timing, the median and the record are made here."""
    times = sample_seconds(run, repeats, warmup, input_device(model))
    median = statistics.median(times)
    return {
        "tokens_per_second": tokens / median,
        "median_seconds": median,
        "spread": relative_spread(times),
        "seconds": times,
        **shape,
        "repeats": repeats,
        "warmup": warmup,
        **speed_environment(model),
    }


def interleaved_seconds(
    runs: Sequence[Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    devices: Sequence[Device] | None = None,
) -> list[list[float]]:
    """Synchronised wall times of several runs alternated round by round: A, B, A, B, ... (one list per run).

    Alternating makes a change of machine load (another process, frequency scaling, thermal throttling) hit every
    run alike, so their per-round ratios stay meaningful where two back-to-back blocks of repeats would not.
    Each run is warmed up `warmup` times first; `devices[i]` is synchronised around run i.
    """
    devices = list(devices) if devices is not None else [None] * len(runs)
    if len(devices) != len(runs):
        raise ValueError(f"{len(runs)} runs but {len(devices)} devices")
    for run in runs:
        for _ in range(warmup):
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, device, times in zip(runs, devices, samples, strict=True):
            times.append(time_once(run, device))
    return samples


SpeedStatus = Literal["reported", "noisy", "beyond_ideal"]


@dataclass(frozen=True)
class SpeedVerdict:
    """Whether a measured speed-up may be printed, and how.

    ``noisy``: the spread is wider than the effect (|speed-up - 1|), so the number says nothing and is not shown.
    ``beyond_ideal``: the speed-up exceeds L/L' x (1 + spread), more than removing layers can give; it is shown
    with a warning, because it points at the measurement (load, caches, clocks), not at the model.
    """

    status: SpeedStatus
    speedup: float
    spread: float
    ideal: float | None
    message: str

    @property
    def reported(self) -> bool:
        return self.status != "noisy"

    def cell(self) -> str:
        """The table cell: the speed-up, flagged when beyond the ideal, or 'noisy, not reported'."""
        if self.status == "noisy":
            return "noisy, not reported"
        return f"{self.speedup:.3f}" + (" (!)" if self.status == "beyond_ideal" else "")


def speed_verdict(speedup: float, spread: float, ideal: float | None = None) -> SpeedVerdict:
    """Judges a speed-up (candidate over baseline throughput) against its relative spread and the ideal L/L'."""
    effect = abs(speedup - 1.0)
    if spread > effect:
        message = (
            f"noisy, not reported: the spread ({spread:.1%}) is wider than the effect ({effect:.1%}); "
            "measure with more rounds on an idle machine"
        )
        return SpeedVerdict("noisy", speedup, spread, ideal, message)
    if ideal is not None and speedup > ideal * (1.0 + spread):
        message = (
            f"warning: the measured speed-up {speedup:.3f} exceeds the ideal L/L' = {ideal:.3f} times (1 + spread "
            f"{spread:.1%}) = {ideal * (1.0 + spread):.3f}, more than removing layers can give; the measurement is "
            "suspect (machine load, caches, clocks), not the model"
        )
        return SpeedVerdict("beyond_ideal", speedup, spread, ideal, message)
    return SpeedVerdict("reported", speedup, spread, ideal, f"{speedup:.3f} (spread {spread:.1%})")


def _layers(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "num_hidden_layers", None)


@dataclass(frozen=True)
class SpeedComparison:
    """Interleaved timings of a baseline and a candidate on the same inputs, and what may be concluded from them."""

    kind: str
    baseline_seconds: tuple[float, ...]
    candidate_seconds: tuple[float, ...]
    tokens: int
    shape: dict[str, int]
    environment: dict[str, Any]
    layers: tuple[int | None, int | None] = (None, None)
    warmup: int = 1
    ratios: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.baseline_seconds) != len(self.candidate_seconds) or len(self.baseline_seconds) < 2:
            # One round has no spread, so no verdict could tell its ratio from noise.
            raise ValueError("a comparison needs the same positive number of rounds for both models, at least 2")
        ratios = tuple(b / c for b, c in zip(self.baseline_seconds, self.candidate_seconds, strict=True))
        object.__setattr__(self, "ratios", ratios)

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    @property
    def speedup(self) -> float:
        """Median over rounds of baseline time / candidate time (candidate throughput over the baseline's)."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> float:
        """Interquartile range of the per-round speed-ups over their median."""
        return relative_spread(self.ratios)

    @property
    def ideal(self) -> float | None:
        """L/L': the speed-up of the decoder stack alone, an upper bound for the whole model."""
        before, after = self.layers
        return before / after if before and after else None

    @property
    def verdict(self) -> SpeedVerdict:
        return speed_verdict(self.speedup, self.spread, self.ideal)

    def tokens_per_second(self, which: Literal["baseline", "candidate"]) -> float:
        seconds = self.baseline_seconds if which == "baseline" else self.candidate_seconds
        return self.tokens / statistics.median(seconds)

    def side(self, which: Literal["baseline", "candidate"]) -> dict[str, Any]:
        """One model's measurement in the format of `prefill_tokens_per_second` / `decode_tokens_per_second`."""
        seconds = list(self.baseline_seconds if which == "baseline" else self.candidate_seconds)
        return {
            "tokens_per_second": self.tokens_per_second(which),
            "median_seconds": statistics.median(seconds),
            "spread": relative_spread(seconds),
            "seconds": seconds,
            **self.shape,
            "repeats": self.rounds,
            "warmup": self.warmup,
            "interleaved": True,
            **{k: v for k, v in self.environment.items() if k != "baseline"},
        }

    def shape_text(self) -> str:
        if self.kind == "prefill":
            return f"batch {self.shape['batch_size']} x {self.shape['seqlen']} tokens, no cache"
        return (
            f"batch {self.shape['batch_size']}, prompt {self.shape['prompt_length']}, "
            f"{self.shape['new_tokens']} generated tokens, KV cache"
        )

    def describe(self) -> str:
        """The speed-up (or why it is not reported) with its spread, rounds, ideal, shapes and environment; a
        second line carries the warning when the speed-up is beyond what the removed layers can explain."""
        verdict = self.verdict
        ideal = f"; ideal L/L' = {self.layers[0]}/{self.layers[1]} = {self.ideal:.3f}" if self.ideal else ""
        protocol = f"{self.rounds} interleaved rounds after {self.warmup} warm-up"
        if verdict.reported:
            head = f"{self.kind} speed-up {verdict.cell()} (median of {protocol}, spread {self.spread:.1%}{ideal})"
        else:
            head = (
                f"{self.kind} speed-up: noisy, not reported (spread {self.spread:.1%} over {protocol} is wider than "
                f"the effect {abs(self.speedup - 1):.1%}{ideal})"
            )
        line = f"{head}; {self.shape_text()}; {describe_environment(self.environment)}"
        return line + (f"\n{verdict.message}" if verdict.status == "beyond_ideal" else "")

    def to_dict(self) -> dict[str, Any]:
        verdict = self.verdict
        return {
            "kind": self.kind,
            "speedup": self.speedup,
            "spread": self.spread,
            "ideal": self.ideal,
            "layers": list(self.layers),
            "status": verdict.status,
            "message": verdict.message,
            "rounds": self.rounds,
            "warmup": self.warmup,
            "ratios": list(self.ratios),
            "baseline": self.side("baseline"),
            "candidate": self.side("candidate"),
            **self.shape,
            "environment": self.environment,
        }


def _environment(baseline: nn.Module, candidate: nn.Module) -> dict[str, Any]:
    environment = speed_environment(candidate)
    other = speed_environment(baseline)
    if (other["device"], other["dtype"]) != (environment["device"], environment["dtype"]):
        environment["baseline"] = other
    return environment


def _vocab(baseline: nn.Module, candidate: nn.Module) -> int:
    return min(baseline.config.vocab_size, candidate.config.vocab_size)


@torch.no_grad()
def compare_prefill(
    baseline: nn.Module,
    candidate: nn.Module,
    seqlen: int = 256,
    batch_size: int = 1,
    rounds: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> SpeedComparison:
    """Prefill of two models on the same random tokens, interleaved round by round (see `interleaved_seconds`)."""
    vocab = _vocab(baseline, candidate)
    runs = [_prefill_run(m, _random_ids(m, (batch_size, seqlen), seed, vocab)) for m in (baseline, candidate)]
    shape = {"batch_size": batch_size, "seqlen": seqlen}
    return _interleaved_comparison("prefill", baseline, candidate, runs, batch_size * seqlen, shape, rounds, warmup)


@torch.no_grad()
def compare_decode(
    baseline: nn.Module,
    candidate: nn.Module,
    batch_size: int = 4,
    prompt_length: int = 64,
    new_tokens: int = 32,
    rounds: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> SpeedComparison:
    """Greedy generation of a fixed length by two models on the same prompts, interleaved round by round."""
    models, vocab = (baseline, candidate), _vocab(baseline, candidate)
    runs = [_decode_run(m, _random_ids(m, (batch_size, prompt_length), seed, vocab), new_tokens) for m in models]
    shape = {"batch_size": batch_size, "prompt_length": prompt_length, "new_tokens": new_tokens}
    return _interleaved_comparison("decode", baseline, candidate, runs, batch_size * new_tokens, shape, rounds, warmup)


def _interleaved_comparison(
    kind: Literal["prefill", "decode"],
    baseline: nn.Module,
    candidate: nn.Module,
    runs: Sequence[Callable[[], object]],
    tokens: int,
    shape: dict[str, int],
    rounds: int,
    warmup: int,
) -> SpeedComparison:
    """The one protocol behind `compare_prefill` and `compare_decode`: the baseline's and the candidate's `runs`
    timed alternately, and the record with both environments; only what a run does differs between the two."""
    devices = [input_device(baseline), input_device(candidate)]
    base, cand = interleaved_seconds(runs, rounds, warmup, devices)
    return SpeedComparison(
        kind=kind,
        baseline_seconds=tuple(base),
        candidate_seconds=tuple(cand),
        tokens=tokens,
        shape=shape,
        environment=_environment(baseline, candidate),
        layers=(_layers(baseline), _layers(candidate)),
        warmup=warmup,
    )
