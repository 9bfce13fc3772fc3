"""Compression cost and memory at a real model shape on an accelerator, against one dense forward, in one run.

No 7B or 70B weights can be downloaded or carried to the GPU machine, so the model is built from a config at the
published shape with random weights (cost and memory depend on shapes, not on the weights' values). Protocol (every
number written is measured here, in this run):
- model: LLaMA at `--shape` (llama-2-7b: hidden 4096, MLP 11008, 32 heads, 32 layers; llama-2-70b: hidden 8192, MLP
  28672, 64 heads, 8 KV heads, 80 layers), `--layers` to build fewer (the per-pair workspace does not depend on
  depth; the estimate is read for the depth actually built), random init (std 0.02), `--dtype` on `--device`;
- calibration: `--nsamples` x `--seqlen` tokens of random words through a byte tokenizer (the shape of the paper's
  128 x 2048), batches of `--batch-size`;
- dense forward: the whole model over those batches, no cache, synchronised, median of `--repeats` after a warm-up;
- compression: `--method` with its defaults plus `--method-args`, `--num-layers-to-remove`, timed once with the
  device synchronised at both ends; per-phase times come from the report (each phase synchronised);
- memory: `torch.cuda.max_memory_allocated` over the compression (reset before it), the resident weights before it,
  and `optimum_flatten.estimate.estimate_memory` for the same model, method and calibration;
- profile (`--profile`, diagnostic only: the profiler slows what it watches): the compression under
  `torch.profiler` with each phase annotated; per phase, its wall, host and device time and the operators under it
  with the most device and host time, and the host-device syncs (so a phase bound by launches or reads shows as
  host time well above device time);
- prefill (`--prefill`): 1 x `--prefill-length` random tokens, no cache, median of 5 synchronised forwards after a
  warm-up, dense before and compressed after the compression (not interleaved: the two models are not held at once).

Usage (on a GPU): python -m benchmarks.cost.gpu_shape --shape llama-2-7b --num-layers-to-remove 7 --out cost_7b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from pathlib import Path

SHAPES: dict[str, dict[str, int]] = {
    "llama-2-7b": dict(
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32
    ),
    "llama-2-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80
    ),
    # For trying the script on a CPU: the same code at a size that runs in seconds.
    "tiny": dict(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6
    ),
}
VOCAB = 32000


class ByteTokenizer:
    """Bytes folded into the vocabulary: enough to give the calibration real token ids of a fixed count."""

    eos_token_id = 2
    pad_token_id = 0
    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [3 + b for b in text.encode("utf-8")]}


def random_text(characters: int, seed: int = 0) -> list[str]:
    """Texts of random words, `characters` bytes in all (one token a byte)."""
    rng = random.Random(seed)
    words = ["state", "union", "people", "nation", "law", "year", "work", "peace", "and", "we", "the", "of", "it"]
    texts, total = [], 0
    while total < characters:
        text = " ".join(rng.choice(words) for _ in range(400))
        texts.append(text)
        total += len(text) + 1
    return texts


def record_phase_peaks(device) -> dict[str, int]:
    """Wraps `MethodContext.timer` so that each phase also records the most memory allocated on `device` while it
    ran (phases nest: the peak counter is reset as a phase starts, and a phase's peak is passed up to the phase
    around it). The library itself never resets the counter, which belongs to the user; the benchmark may."""
    import contextlib

    import torch

    from optimum_flatten.compression.method import MethodContext

    peaks: dict[str, int] = {}
    stack: list[int] = []
    timer = MethodContext.timer

    @contextlib.contextmanager
    def timed(self, phase: str):
        if stack:
            stack[-1] = max(stack[-1], torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        stack.append(0)
        try:
            with timer(self, phase):
                yield
        finally:
            peak = max(stack.pop(), torch.cuda.max_memory_allocated(device))
            peaks[phase] = max(peaks.get(phase, 0), peak)
            if stack:
                stack[-1] = max(stack[-1], peak)

    MethodContext.timer = timed
    return peaks


def annotate_phases() -> None:
    """Wraps `MethodContext.timer` so each phase is also a `torch.profiler.record_function` range (the profile's
    phases; the library's timer stays free of the profiler)."""
    import contextlib

    import torch

    from optimum_flatten.compression.method import MethodContext

    timer = MethodContext.timer

    @contextlib.contextmanager
    def annotated(self, phase: str):
        with torch.profiler.record_function(f"phase:{phase}"), timer(self, phase):
            yield

    MethodContext.timer = annotated


def _event_times(event) -> tuple[float, float]:
    """(self host µs, self device µs) of a profiler event, across torch's renamings of the device fields."""
    device = getattr(event, "self_device_time_total", None)
    if device is None:
        device = getattr(event, "self_cuda_time_total", 0.0)
    return float(event.self_cpu_time_total), float(device or 0.0)


def summarise_profile(profile, top: int = 12) -> dict:
    """Per annotated phase: wall ms, the host and device ms of everything under it, host-device syncs, and the
    operators with the most device and the most host time (self times, so nothing is counted twice)."""
    phases: dict[str, dict] = {}
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
    for event in profile.events():
        if not event.name.startswith("phase:"):
            continue
        name = event.name.removeprefix("phase:")
        entry = phases.setdefault(name, {"wall_ms": 0.0, "host_ms": 0.0, "device_ms": 0.0, "syncs": 0, "ops": {}})
        entry["wall_ms"] += event.cpu_time_total / 1e3
        stack = list(event.cpu_children)
        while stack:
            child = stack.pop()
            if child.name.startswith("phase:"):
                continue  # a nested phase is summarised on its own
            stack.extend(child.cpu_children)
            host, device = _event_times(child)  # an op's self device time is that of the kernels it launched
            op = entry["ops"].setdefault(child.name, [0, 0.0, 0.0])
            op[0] += 1
            op[1] += host / 1e3
            op[2] += device / 1e3
            entry["host_ms"] += host / 1e3
            entry["device_ms"] += device / 1e3
            if child.name.startswith(sync_names):
                entry["syncs"] += 1
    for entry in phases.values():
        ops = entry.pop("ops")
        rows = [
            {"op": name, "calls": calls, "host_ms": round(host, 2), "device_ms": round(device, 2)}
            for name, (calls, host, device) in ops.items()
        ]
        entry["top_device"] = sorted(rows, key=lambda r: -r["device_ms"])[:top]
        entry["top_host"] = sorted(rows, key=lambda r: -r["host_ms"])[:top]
        for key in ("wall_ms", "host_ms", "device_ms"):
            entry[key] = round(entry[key], 1)
    return phases


def run_header(device, dtype: str, shapes: dict) -> dict:
    """What every GPU-shape result opens with: the device by name, the dtype, torch's version and the shapes."""
    import torch

    from optimum_flatten.evaluation.speed import device_name

    return {"device": device_name(device), "dtype": dtype, "torch": torch.__version__, "shapes": shapes}


def build_model(shape: str, layers: int | None, dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(SHAPES[shape])
    if layers:
        sizes["num_hidden_layers"] = layers
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5, **sizes)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model never exists in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="build this many layers (default: the shape's)")
    parser.add_argument("--method", default="flattengpt")
    parser.add_argument("--method-args", default="{}", help="method options as JSON")
    parser.add_argument("--num-layers-to-remove", type=int, default=7)
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--prefill-length", type=int, default=2048)
    parser.add_argument("--phase-peaks", action="store_true", help="record each phase's peak memory (CUDA)")
    parser.add_argument("--profile", action="store_true", help="profile the compression by phase (diagnostic)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from benchmarks.cost.run import cost_fields
    from optimum_flatten import FlattenConfig, FlattenQuantizer
    from optimum_flatten.calibration import build_calibration_batches
    from optimum_flatten.estimate import estimate_memory, modelled_methods
    from optimum_flatten.evaluation.speed import prefill_tokens_per_second, sample_seconds

    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = build_model(args.shape, args.layers, dtype, device)
    method_args = json.loads(args.method_args)
    tokenizer = ByteTokenizer()
    config = FlattenConfig(
        method=args.method,
        num_layers_to_remove=args.num_layers_to_remove,
        dataset=random_text(args.nsamples * args.seqlen + 4 * args.seqlen),
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        batch_size=args.batch_size,
        seed=0,
        **method_args,
    )
    batches = build_calibration_batches(tokenizer, config.calibration)
    estimate = None
    if args.method in modelled_methods():
        estimate = estimate_memory(
            model, args.method, args.num_layers_to_remove, args.nsamples, args.seqlen, args.batch_size, method_args
        ).to_dict()

    def dense_forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model(
                    input_ids=batch.input_ids.to(device),
                    attention_mask=batch.attention_mask.to(device),
                    use_cache=False,
                    logits_to_keep=1,
                )

    forwards = sample_seconds(dense_forward, repeats=args.repeats, warmup=1, device=device)
    dense = statistics.median(forwards)
    prefill_dense = prefill_tokens_per_second(model, args.prefill_length, repeats=5) if args.prefill else None

    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    phase_peaks = record_phase_peaks(device) if cuda and args.phase_peaks else None
    quantizer = FlattenQuantizer(config, progress=False)
    profiler = contextlib.nullcontext()
    if args.profile:
        annotate_phases()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        profiler = torch.profiler.profile(activities=activities)
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profiler as profile:
        quantizer.compress(model, tokenizer)
        if cuda:
            torch.cuda.synchronize(device)
    compress_seconds = time.perf_counter() - start
    report = quantizer.report
    memory = {}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        if phase_peaks is not None:  # the counter was reset per phase: the overall peak is the largest phase's
            peak = max([peak, *phase_peaks.values()])
        memory = {
            "allocated_before_bytes": allocated_before,
            "peak_allocated_bytes": peak,
            "peak_minus_resident_bytes": peak - allocated_before,
            "peak_allocated_gib": peak / 2**30,
            "workspace_gib": (peak - allocated_before) / 2**30,
        }
        if phase_peaks is not None:
            memory["phase_workspace_gib"] = {k: (v - allocated_before) / 2**30 for k, v in phase_peaks.items()}
    prefill_compressed = prefill_tokens_per_second(model, args.prefill_length, repeats=5) if args.prefill else None
    sizes = dict(SHAPES[args.shape], num_hidden_layers=args.layers or SHAPES[args.shape]["num_hidden_layers"])
    calibration = f"{args.nsamples} x {args.seqlen} tokens, batches of {args.batch_size}"
    shapes = {"shape": args.shape, **sizes, "vocab_size": VOCAB, "calibration": calibration}
    result = {
        **run_header(device, args.dtype, {**shapes, "tokens": report["calibration"]["tokens"]}),
        "protocol": {
            "weights": "random init (std 0.02), built from the config on the device",
            "calibration": "random words through a byte tokenizer",
            "dense_forward": f"whole model, no cache, logits of the last position only, synchronised, median of "
            f"{args.repeats} after a warm-up",
            "compression": f"{args.method} defaults + {method_args}, {args.num_layers_to_remove} layers removed, "
            "timed once, synchronised",
            "label": args.label,
        },
        "weights_bytes": weights_bytes,
        # How a linear replacement's fit got its states (held, one pass with the selection, streamed), where one ran.
        "fit_states": {
            key: value
            for key, value in {
                "held_states": report.get("held_states"),
                "one_pass": report.get("one_pass"),
                "states": (report.get("replaceme") or report.get("linear_replacement") or {}).get("states"),
            }.items()
            if value is not None
        },
        **cost_fields(dense, forwards, compress_seconds, report),
        "memory": memory,
        "estimate": estimate,
        "prefill": {"dense": prefill_dense, "compressed": prefill_compressed} if args.prefill else None,
    }
    if args.profile:
        result["profile"] = summarise_profile(profile)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    line = (
        f"{args.shape} ({sizes['num_hidden_layers']} layers) {args.method} {method_args}: dense forward {dense:.2f} s, "
        f"compression {compress_seconds:.2f} s = {result['compress_in_dense_forwards']:.2f} dense forwards; "
        f"phases {json.dumps({k: round(v, 2) for k, v in report['timings_seconds'].items()})}"
    )
    if memory:
        line += f"; peak {memory['peak_allocated_gib']:.1f} GiB, workspace {memory['workspace_gib']:.1f} GiB"
    if estimate:
        line += f"; estimated workspace {estimate['workspace_bytes']['peak'] / 2**30:.1f} GiB"
    if prefill_dense:
        line += (
            f"; prefill {prefill_dense['tokens_per_second']:.0f} -> {prefill_compressed['tokens_per_second']:.0f} tok/s"
        )
    print(line, flush=True)


if __name__ == "__main__":
    main()
