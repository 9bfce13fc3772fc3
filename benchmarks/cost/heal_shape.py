"""What healing costs at a real model shape on one accelerator: each mode's peak memory and training speed, the mode the
default picks on an 80 GB and a 141 GB device, the footprint estimate against the measured peak, and the teacher's
sampling speed for healing on its own text.

No 7B weights can be carried to the GPU machine, so the models are built from a config at the published shape with
random weights: memory and speed depend on shapes, not on values. Protocol (every number written is measured here, in
this run, except the mode choice, which is the library's own memory check read at a stated free memory):
- teacher: LLaMA at `--shape` (benchmarks.cost.gpu_shape's shapes; llama-2-7b by default), random init, `--dtype`,
  built on `--device`;
- student: a copy of the teacher compressed by ReplaceMe (its defaults, `--num-layers-to-remove` layers, calibrated on
  16 x 256 tokens of random words: the cheapest calibration that gives the report `local` needs); compressed once,
  and each mode heals its own copy of it, so every mode starts from the same weights;
- healing: `recover` with the teacher held on the device, distillation, `--steps` optimiser steps of the
  RecoveryConfig defaults' batch (4 rows of 256 tokens) unless `--rows`/`--seqlen` say otherwise, on random words
  through the tiny character tokenizer (`utils.tiny`; the vocabulary's size is the model's, so the logits and the
  loss are full size), the gate's 8 held-out rows scored before and after;
- per mode: ``torch.cuda.max_memory_allocated`` over `recover` (reset before it) less what was allocated before it
  (teacher, the compressed student kept to copy from, the mode's copy), the same for the allocator's reserved memory
  (the cache emptied before), training tokens a second from the log's
  ``train_seconds``, and for `full` `recovery.footprint.full_footprint`'s estimate of the same run (its state and
  activation terms: the teacher is resident) against the measured rise;
- the default mode (`ModeChoice`, the library's check) with the free memory of an 80 GiB and a 141 GiB device that
  holds the teacher and the student and nothing else;
- sampling: `recovery.teacher_text.sample_teacher_rows` from a random first token (`sampling_start="random"`), one
  batch of the size the library picks for the free memory (`default_batch_size`), rows of `--sample-seqlen` tokens,
  synchronised, with the teacher alone on the device (before the student exists, as `recover` samples before it
  trains); generated tokens a second and the peak.

Each mode's row is written to `--out` as soon as it is measured (a call cut short keeps what finished); a mode that
runs out of memory is recorded as such and the next one runs.

Usage (on a GPU): python -m benchmarks.cost.heal_shape --shape llama-2-7b --out heal_7b.json
On a CPU, to check the script: python -m benchmarks.cost.heal_shape --shape tiny --device cpu --dtype float32 --out x
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.cost.gpu_shape import SHAPES, VOCAB, build_model, run_header

#: (label, RecoveryConfig overrides): the modes of `recovery.selection.MODES` a user picks at this size, most wanted
#: first (a step cut short keeps the rows before it).
MODES: list[tuple[str, dict[str, Any]]] = [
    ("full", {"mode": "full"}),
    ("full_frozen_embeddings", {"mode": "full", "train_embeddings": False}),
    ("local", {"mode": "local"}),
    ("lora", {"mode": "lora"}),
    ("last_k", {"mode": "last_k"}),
    ("full_adafactor", {"mode": "full", "extra_training_args": {"optim": "adafactor"}}),
]
GIB = 2**30
#: The devices the default's choice is read for: total memory in GiB.
DEVICES_GIB = (80, 141)


def _synchronise(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def meta_student(result: dict[str, Any]):
    """The measured student's shape on the meta device (the layers ReplaceMe kept, its dtype, SDPA attention as
    measured): what today's footprint is read from when a page is rendered, so the page compares the measurement with
    the estimate the code makes now, not the one it made then."""
    import torch

    shapes = result["shapes"]
    model = build_model(shapes["shape"], shapes["student_layers"], getattr(torch, result["dtype"]), "meta")
    model.config._attn_implementation = "sdpa"
    return model


def footprint_today(result: dict[str, Any], label: str):
    """`full_footprint` on a CUDA device, as the code estimates it now, of mode `label`'s run in `result`."""
    from optimum_flatten.recovery import RecoveryConfig
    from optimum_flatten.recovery.footprint import full_footprint

    shapes = result["shapes"]
    overrides = dict(MODES)[label]
    config = RecoveryConfig(per_device_train_batch_size=shapes["rows_per_step"], seqlen=shapes["seqlen"], **overrides)
    return full_footprint(meta_student(result), config, accelerator=True)


def default_today(result: dict[str, Any], total_gib: int) -> str:
    """The mode the default picks today (`ModeChoice`'s order, without bitsandbytes) on a CUDA device of `total_gib`
    holding the measured teacher and student."""
    from optimum_flatten.recovery import RecoveryConfig
    from optimum_flatten.recovery.footprint import candidate_footprints

    free = (total_gib - result["teacher_gib"] - result["student_gib"]) * GIB
    candidates = candidate_footprints(meta_student(result), RecoveryConfig(), accelerator=True)
    for name, footprint in candidates:
        if "adamw_bnb_8bit" not in name and footprint.fits(free):
            return "full" if name == "as asked" else f"full {name}"
    return "local"


def compressed_student(teacher, tokenizer, texts: list[str], layers: int):
    """A copy of `teacher` compressed by ReplaceMe with its defaults, and the report `local` reads its spans from."""
    from optimum_flatten import FlattenConfig, FlattenQuantizer

    student = copy.deepcopy(teacher)
    config = FlattenConfig(
        method="replaceme", num_layers_to_remove=layers, dataset=texts, nsamples=16, seqlen=256, batch_size=8, seed=0
    )
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(student, tokenizer)
    return student, quantizer.report


def default_choice(student, config, resident: int, total_gib: int) -> dict[str, Any]:
    """The mode `recover` picks by default on a device of `total_gib` that holds `resident` bytes (teacher and
    student): `ModeChoice` with that free memory in place of the device's own reading."""
    from optimum_flatten.recovery import footprint

    free = total_gib * GIB - resident
    reading = footprint.available_bytes
    footprint.available_bytes = lambda device: free
    try:
        choice = footprint.ModeChoice(student, config, lambda: 0)
        fits = choice()
    finally:
        footprint.available_bytes = reading
    mode = "local" if not fits else "full"
    if fits and choice.optimiser:
        mode += f" with {choice.optimiser}"
    if fits and choice.freezes_embeddings:
        mode += ", embeddings frozen"
    return {"device_gib": total_gib, "free_gib": round(free / GIB, 1), "mode": mode, "check": choice.line}


def heal_once(student, teacher, tokenizer, texts, report, overrides, args, device) -> dict[str, Any]:
    """One mode's healing of `student` (changed in place): its peak memory over `recover`, its speed and its log."""
    import torch

    from optimum_flatten.recovery import RecoveryConfig, recover
    from optimum_flatten.recovery.footprint import full_footprint

    config = RecoveryConfig(
        max_tokens=args.steps * args.rows * args.seqlen,
        per_device_train_batch_size=args.rows,
        seqlen=args.seqlen,
        seed=0,
        **overrides,
    )
    estimate = full_footprint(student, config) if config.mode == "full" else None
    _synchronise(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocated(device)
    reserved_before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    _, log = recover(student, tokenizer, texts, config, teacher=teacher, report=report)
    _synchronise(device)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    reserved = torch.cuda.max_memory_reserved(device) - reserved_before if device.type == "cuda" else 0
    row = {
        "mode": log["mode"],
        "optimizer": log["optimizer"],
        "embeddings": log.get("embeddings", "trained"),
        "steps": log["steps"],
        "tokens_trained": log["tokens_trained"],
        "train_seconds": log["train_seconds"],
        "train_tokens_per_second": log["tokens_trained"] / max(log["train_seconds"], 1e-9),
        "recover_wall_seconds": wall,
        "allocated_before_gib": before / GIB,
        "peak_allocated_gib": peak / GIB,
        "rise_gib": (peak - before) / GIB,
        # What the caching allocator took from the device (allocations and its fragmentation): what must be free.
        "reserved_rise_gib": reserved / GIB,
        "gate": log["gate"],
    }
    if estimate is not None:
        total = estimate.state + estimate.activations
        row["estimate"] = {
            "state_gib": estimate.state / GIB,
            "activations_gib": estimate.activations / GIB,
            "total_gib": total / GIB,
            # Above (positive) or below (negative) the measured rise, as a share of it; a CPU has no such reading.
            "over_measured": total / (peak - before) - 1 if peak > before else None,
            "over_reserved": total / reserved - 1 if reserved > 0 else None,
        }
    return row


def sampling_speed(teacher, tokenizer, seqlen: int, device) -> dict[str, Any]:
    """One batch of the teacher's own text from a random first token, the batch sized as the library sizes it."""
    import torch

    from optimum_flatten.recovery.teacher_text import default_batch_size, sample_teacher_rows

    rows = default_batch_size(teacher, seqlen)
    _synchronise(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocated(device)
    start = time.perf_counter()
    sampled, record = sample_teacher_rows(
        teacher, tokenizer, rows, seqlen, seed=0, start="random", batch_size=None, progress=False
    )
    _synchronise(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    generated = record["generated_tokens"]
    return {
        "rows": len(sampled),
        "batch_size": record.get("batch_size"),
        "seqlen": seqlen,
        "seconds": seconds,
        "generated_tokens_per_second": generated / seconds,
        "record": {k: v for k, v in record.items() if k != "excerpts"},
        "rise_gib": (peak - before) / GIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    parser.add_argument("--num-layers-to-remove", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps per mode")
    parser.add_argument("--rows", type=int, default=4, help="rows a step (RecoveryConfig's default)")
    parser.add_argument("--seqlen", type=int, default=256, help="tokens a row (RecoveryConfig's default)")
    parser.add_argument("--sample-seqlen", type=int, default=512, help="tokens of each sampled row")
    parser.add_argument("--modes", nargs="+", default=None, help="labels of the modes to run (default: all)")
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from optimum_flatten.recovery import RecoveryConfig
    from optimum_flatten.utils.tiny import tiny_texts, tiny_tokenizer

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tokenizer = tiny_tokenizer()
    texts = tiny_texts(num=400 + 2 * args.steps * args.rows * args.seqlen // 200, seed=0)
    teacher = build_model(args.shape, None, dtype, device)
    teacher.requires_grad_(False)
    # The teacher's sampling first, with the teacher alone on the device (as `recover` samples before it trains).
    sampling = None if args.skip_sampling else sampling_speed(teacher, tokenizer, args.sample_seqlen, device)
    if sampling is not None:
        print("sampling", json.dumps(sampling), flush=True)
    started = time.perf_counter()
    base, report = compressed_student(teacher, tokenizer, texts, args.num_layers_to_remove)
    compress_seconds = time.perf_counter() - started
    base.requires_grad_(False)
    resident = sum(p.numel() * p.element_size() for m in (teacher, base) for p in m.parameters())
    default_config = RecoveryConfig(max_tokens=args.steps * args.rows * args.seqlen, seed=0)
    shapes = {"shape": args.shape, **SHAPES[args.shape], "vocab_size": VOCAB, "student_layers": len(base.model.layers)}
    result: dict[str, Any] = {
        **run_header(
            device, args.dtype, {**shapes, "rows_per_step": args.rows, "seqlen": args.seqlen, "steps": args.steps}
        ),
        "protocol": {
            "weights": "random init (std 0.02), built from the config on the device",
            "student": f"ReplaceMe defaults, {args.num_layers_to_remove} layers removed, 16 x 256 calibration tokens",
            "healing": "recover(), distillation from the teacher held on the device, random words through the tiny "
            "character tokenizer, the gate's 8 held-out rows scored before and after",
            "memory": "torch.cuda.max_memory_allocated over recover(), less what was allocated before it",
        },
        "teacher_gib": sum(p.numel() * p.element_size() for p in teacher.parameters()) / GIB,
        "student_gib": sum(p.numel() * p.element_size() for p in base.parameters()) / GIB,
        "compress_seconds": compress_seconds,
        "default_mode": [default_choice(base, default_config, resident, total) for total in DEVICES_GIB],
        "sampling": sampling,
        "modes": {},
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"compressed in {compress_seconds:.1f} s; default mode {result['default_mode']}", flush=True)
    for label, overrides in MODES:
        if args.modes and label not in args.modes:
            continue
        student = copy.deepcopy(base).requires_grad_(True)
        _free(device)  # the reserved memory's rise starts from an emptied cache
        try:
            row = heal_once(student, teacher, tokenizer, texts, report, overrides, args, device)
        except torch.OutOfMemoryError as error:
            row = {"status": f"out of memory: {str(error).splitlines()[0]}"}
        del student
        _free(device)
        result["modes"][label] = row
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(label, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
