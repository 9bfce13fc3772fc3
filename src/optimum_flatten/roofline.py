"""Predicted seconds from the machine-free cost: stack passes and the method's own arithmetic, on a named device.

Torch-free (the command line reads the presets before anything heavy is imported). The model is a roofline with
stated efficiencies, not a fit per run:

- **a stack pass** takes what one forward of the original stack over the calibration tokens takes: its flops
  (`utils.flops.dense_forward_flops`) at the model dtype's tensor-core peak times `FORWARD_EFFICIENCY`, or the
  weights read once per calibration batch at the memory bandwidth, whichever is longer (at 8 × 2048-token batches a
  7B forward is compute-bound by two orders of magnitude; a small batch can be bandwidth-bound);
- **a product** (a moment, a GEMM in a solve) runs at its precision's peak times `PRODUCT_EFFICIENCY`;
- **a factorisation or triangular solve** at its precision's peak times `FACTORISATION_EFFICIENCY` (Cholesky, its
  solves and inverse are blocked algorithms whose panels and dependencies keep a GPU well below its GEMM rate);
- **a scalar read into Python** (`float(t[i])`) waits `HOST_READ_SECONDS` for the device each time.

Elementwise work (casts, centring, masks, norms, the similarity pass's dot products) is not modelled: it is memory-
bound and small beside the products at the sizes where time matters, and where it is not (a narrow model), the
estimate is low by that much.

Peaks are the vendors' dense figures (no structured sparsity): float64 products at the FP64 tensor-core rate (DGEMM
and the factorisations use it on A100 and H100), float32 at the CUDA cores' FP32 rate (torch's default for float32
matmul, `set_float32_matmul_precision("highest")`), ``tf32`` at the TF32 tensor-core rate.

Sources:
- H100 (SXM5, 80 GB HBM3): NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table 3, and the H100
  datasheet: FP64 tensor core 66.9, FP32 66.9, TF32 494.7, BF16 / FP16 989.4 TFLOPS dense; HBM3 3.35 TB/s.
- H200 (SXM, 141 GB HBM3e): NVIDIA H200 datasheet (2024): the H100 SXM's compute (FP64 tensor core 67, FP32 67,
  TF32 989 and BF16 1,979 TFLOPS with sparsity, half of that dense); HBM3e 4.8 TB/s.
- A100 (SXM4, 80 GB): NVIDIA A100 datasheet (2021): FP64 tensor core 19.5, FP32 19.5, TF32 156, BF16 / FP16 312
  TFLOPS dense; HBM2e 2,039 GB/s.

Efficiencies and how they were set (issue 31; the predictions against the issue's H100 rows are in docs/cli.md and
tests/test_estimate_compute.py):
- `FORWARD_EFFICIENCY` 0.5: the one dense forward measured at LLaMA-2-7B shape on an H100 (7.61 s for 3.68 PFLOP,
  0.49 of the BF16 peak), the typical utilisation of an eager transformers forward at large batches;
- `PRODUCT_EFFICIENCY`: 0.75 for FP32 and FP64 (large GEMMs on CUDA cores and FP64 tensor cores run close to
  their peaks, which boost clocks do not inflate as much as the tensor-core figures'; the FP32 second moment of the
  7B covariance measured 0.78 on an H100 in the runs of 2026-11-25, before the issue's rows), 0.4 for TF32 (the same
  moment on TF32 measured 0.42 then), 0.5 for BF16 / FP16 as the forward;
- `FACTORISATION_EFFICIENCY` 0.25 and `HOST_READ_SECONDS` 25 µs: general figures (cuSOLVER's Cholesky and
  triangular solves at sizes of 10³–10⁴ reach a quarter to a half of the GEMM rate; a synchronous scalar read
  costs a kernel launch, a copy and a synchronisation), not measured apart here; the attention solve and the MLP
  solve of the issue's rows, the only phases they dominate, are how they were checked;
- `LAUNCH_SECONDS` 8 µs, PyTorch's usual per-op overhead in eager mode: added after the attention solve (a Python
  loop of some 34 small ops per KV group and elimination step) came out 30% under its measured time without it;
  the general figure, not the one that would fit that row (about 16 µs). With it that phase is 15% under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: Fraction of the model dtype's peak a forward of the stack reaches.
FORWARD_EFFICIENCY = 0.5
#: Fraction of its precision's peak a product reaches.
PRODUCT_EFFICIENCY = {"bfloat16": 0.5, "float16": 0.5, "tf32": 0.4, "float32": 0.75, "float64": 0.75}
#: Fraction of its precision's peak a factorisation or triangular solve reaches.
FACTORISATION_EFFICIENCY = 0.25
#: Seconds one synchronous scalar read of a device value costs.
HOST_READ_SECONDS = 25e-6
#: Seconds one small op in a Python loop costs (PyTorch's per-op dispatch and launch, which a sync in the loop puts
#: on the critical path).
LAUNCH_SECONDS = 8e-6


@dataclass(frozen=True)
class DeviceSpec:
    """A device's dense peaks per precision (TFLOPS) and its memory bandwidth (GB/s)."""

    name: str
    peak_tflops: dict[str, float]
    bandwidth_gbs: float
    source: str = ""
    #: Seconds per synchronous scalar read, and per small op in a loop.
    host_read_seconds: float = HOST_READ_SECONDS
    launch_seconds: float = LAUNCH_SECONDS

    def peak(self, precision: str) -> float:
        """FLOP/s of `precision`; float16 falls back to bfloat16's rate and back (the same on every preset)."""
        for name in (precision, {"float16": "bfloat16", "bfloat16": "float16"}.get(precision, precision)):
            if name in self.peak_tflops:
                return self.peak_tflops[name] * 1e12
        raise ValueError(
            f"device {self.name!r} states no peak for {precision!r} (it has {sorted(self.peak_tflops)}); give one "
            f"with --peak-tflops {precision}=TFLOPS."
        )


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "h100",
        {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9, "float64": 66.9},
        3350.0,
        "NVIDIA H100 SXM5 80 GB (whitepaper table 3, datasheet), dense",
    ),
    "h200": DeviceSpec(
        "h200",
        {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9, "float64": 66.9},
        4800.0,
        "NVIDIA H200 SXM 141 GB (datasheet), dense",
    ),
    "a100": DeviceSpec(
        "a100",
        {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5, "float64": 19.5},
        2039.0,
        "NVIDIA A100 SXM4 80 GB (datasheet), dense",
    ),
}


def device_from_options(name: str | None, peak_tflops: str | None, bandwidth_gbs: float | None) -> DeviceSpec | None:
    """The device of `estimate`'s options: a preset (`DEVICES`), a preset with some figures replaced, or one given
    whole by ``--peak-tflops`` (one number for every precision, or ``precision=TFLOPS`` pairs separated by commas)
    and ``--bandwidth-gbs``. None when none is asked.

    Raises:
        ValueError: an unknown preset, a malformed or non-positive figure, or a device given without both figures.
    """
    if name is None and peak_tflops is None and bandwidth_gbs is None:
        return None
    if name is not None and name not in DEVICES:
        raise ValueError(
            f"unknown device {name!r}; known: {sorted(DEVICES)} (or give --peak-tflops and --bandwidth-gbs)."
        )
    base = DEVICES[name] if name is not None else None
    if base is None and (peak_tflops is None or bandwidth_gbs is None):
        raise ValueError(
            "a device without a preset needs both --peak-tflops and --bandwidth-gbs, got "
            f"peak_tflops={peak_tflops!r}, bandwidth_gbs={bandwidth_gbs!r}; or name one of {sorted(DEVICES)} "
            "with --device."
        )
    peaks = dict(base.peak_tflops) if base is not None else {}
    if peak_tflops is not None:
        peaks.update(parse_peaks(peak_tflops))
    bandwidth = base.bandwidth_gbs if bandwidth_gbs is None else float(bandwidth_gbs)
    if not 0 < bandwidth < math.inf:  # inf would predict 0 s for every phase
        raise ValueError(f"--bandwidth-gbs must be positive, a finite number, got {bandwidth_gbs!r}.")
    label = name or "custom"
    if base is not None and (peak_tflops is not None or bandwidth_gbs is not None):
        label += " (figures given)"
    return DeviceSpec(label, peaks, bandwidth, base.source if base is not None else "given on the command line")


def parse_peaks(text: str) -> dict[str, float]:
    """``"989"`` (every precision) or ``"bfloat16=989,float32=67"`` → TFLOPS per precision."""
    from .utils.flops import PRECISIONS

    def number(value: str) -> float:
        try:
            result = float(value)
        except ValueError:
            result = float("nan")
        if not 0 < result < math.inf:
            raise ValueError(f"--peak-tflops takes positive TFLOPS, a finite number, got {value!r} in {text!r}.")
        return result

    if "=" not in text:
        return dict.fromkeys(PRECISIONS, number(text))
    peaks = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in PRECISIONS:
            raise ValueError(f"--peak-tflops names precisions among {list(PRECISIONS)}, got {key!r} in {text!r}.")
        peaks[key] = number(value)
    return peaks


@dataclass
class TimePrediction:
    """Predicted seconds per phase (passes and arithmetic apart) and in all, on `device`."""

    device: DeviceSpec
    forward_seconds: float
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    total_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.name,
            "peak_tflops": dict(self.device.peak_tflops),
            "bandwidth_gbs": self.device.bandwidth_gbs,
            "source": self.device.source,
            "efficiencies": {
                "forward": FORWARD_EFFICIENCY,
                "product": dict(PRODUCT_EFFICIENCY),
                "factorisation": FACTORISATION_EFFICIENCY,
                "host_read_seconds": self.device.host_read_seconds,
                "launch_seconds": self.device.launch_seconds,
            },
            "dense_forward_seconds": self.forward_seconds,
            "phases": self.phases,
            "total_seconds": self.total_seconds,
            "notes": list(self.notes),
        }


def forward_seconds(
    dense_forward_flops: float, model_precision: str, stack_bytes: float, batches: int, device: DeviceSpec
) -> float:
    """One forward of the stack over the calibration tokens: compute at `FORWARD_EFFICIENCY` of the model dtype's
    peak, or the stack's weights read once per batch, whichever is longer."""
    compute = dense_forward_flops / (device.peak(model_precision) * FORWARD_EFFICIENCY)
    memory = stack_bytes * batches / (device.bandwidth_gbs * 1e9)
    return max(compute, memory)


def arithmetic_seconds(kinds: dict[str, dict[str, float]], device: DeviceSpec) -> float:
    """Seconds of one phase's arithmetic (`utils.flops.ArithmeticCount.phases[phase]`)."""
    seconds = 0.0
    for kind, values in kinds.items():
        for precision, amount in values.items():
            if kind == "host_reads":
                seconds += amount * device.host_read_seconds
            elif kind == "launches":
                seconds += amount * device.launch_seconds
            elif kind == "factorisation":
                seconds += amount / (device.peak(precision) * FACTORISATION_EFFICIENCY)
            else:
                seconds += amount / (device.peak(precision) * PRODUCT_EFFICIENCY.get(precision, 0.5))
    return seconds


def predict(
    device: DeviceSpec,
    dense_forward_flops: float,
    model_precision: str,
    stack_bytes: float,
    batches: int,
    phase_passes: dict[str, float] | None,
    arithmetic: dict[str, dict[str, dict[str, float]]] | None,
    total_passes: float,
) -> TimePrediction:
    """Seconds per phase: its stack passes × one forward's seconds, plus its arithmetic's (`arithmetic_seconds`).

    Without a per-phase split (`phase_passes` None: the method states no compute model), the total is the total
    passes' time alone, and a note says the arithmetic is not counted.
    """
    forward = forward_seconds(dense_forward_flops, model_precision, stack_bytes, batches, device)
    prediction = TimePrediction(device, forward)
    if phase_passes is None:
        prediction.total_seconds = total_passes * forward
        prediction.notes.append("this method states no compute model: its own arithmetic is not in the total")
        return prediction
    arithmetic = arithmetic or {}
    for name in dict.fromkeys([*phase_passes, *arithmetic]):
        passes = phase_passes.get(name, 0.0) * forward
        own = arithmetic_seconds(arithmetic.get(name, {}), device)
        prediction.phases[name] = {"passes_seconds": passes, "arithmetic_seconds": own, "seconds": passes + own}
    prediction.total_seconds = sum(p["seconds"] for p in prediction.phases.values())
    return prediction
