"""A method's compression cost (FlattenGPT's by default) against one dense forward over the same calibration tokens,
in one run.

Protocol (every number written is measured here, in this run):
- model: a bundled model (`--model`, default smollm2 = SmolLM2-135M-Instruct, 30 layers), float32, on the CPU;
- calibration: State of the Union speeches before 2000, packed, `--nsamples` x `--seqlen` tokens in batches of
  `--batch-size`, seed 0 (the tokens `FlattenQuantizer` calibrates on);
- torch threads: `--threads` (1 by default: the figure is the ratio, and one thread keeps it steady on a shared
  machine);
- dense forward: the whole model (embeddings to logits) over those batches, no cache, timed `--repeats` times
  after one warm-up batch; the median is the unit;
- compression: `--method` (default flattengpt) with its defaults (plus `--method-args`), `--num-layers-to-remove`
  layers, timed once from `compress` call to return, with the report's per-phase `timings_seconds` and
  `cost.stack_passes`;
- `--save-weights PATH` stores the compressed state dict and the kept heads/channels; `--compare-weights PATH`
  compares this run's with a stored one (same plan, kept KV groups and channels; max abs and max relative weight
  difference, relative to each tensor's largest entry), which is how a faster code path is checked against the old.

Usage: python -m benchmarks.cost.run [--model smollm2] [--method flattengpt] [--threads 1]
Writes benchmarks/results/cost_<model>.json (FlattenGPT) or cost_<model>_<method>.json unless --out is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def dense_forward_seconds(model, batches, repeats: int) -> list[float]:
    """Wall time of one full forward (embeddings to logits) over every batch, `repeats` times after a warm-up."""
    import torch

    with torch.no_grad():
        model(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask, use_cache=False)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for batch in batches:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            times.append(time.perf_counter() - start)
    return times


def cost_fields(dense: float, forwards: list[float], compress_seconds: float, report: dict) -> dict:
    """The cost entries every cost result holds: the dense unit, the compression in it, per phase, in stack passes."""
    return {
        "dense_forward_seconds": dense,
        "dense_forward_seconds_all": forwards,
        "compress_seconds": compress_seconds,
        "compress_in_dense_forwards": compress_seconds / dense,
        "timings_seconds": report["timings_seconds"],
        "phases_in_dense_forwards": {k: v / dense for k, v in report["timings_seconds"].items()},
        "stack_passes": report["cost"]["stack_passes"],
        "plan": report["plan_summary"],
    }


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, target, calibration shape and thread count every cost run takes (`cpu_run_header` states them)."""
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "qwen2.5-0.5b"])
    parser.add_argument("--num-layers-to-remove", type=int, default=6)
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)


def cpu_run_header(args: argparse.Namespace, model, report) -> dict:
    """Device, dtype, threads and shapes of a float32 CPU compression run, as every cost result states them."""
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "dtype": "float32",
        "threads": args.threads,
        "shapes": {
            "model": args.model,
            "layers": report["num_layers_before"],
            "hidden_size": model.config.hidden_size,
            "intermediate_size": model.config.intermediate_size,
            "calibration": f"{args.nsamples} x {args.seqlen} tokens, batches of {args.batch_size}",
            "tokens": report["calibration"]["tokens"],
        },
    }


def compare(saved: dict, current: dict) -> dict:
    """Same plan and kept units, and how far the weights moved (absolute, and relative to each tensor's max)."""
    same_groups = saved["groups"] == current["groups"]
    max_abs, max_rel, worst = 0.0, 0.0, None
    for name, tensor in current["state_dict"].items():
        old = saved["state_dict"][name].double()
        diff = float((tensor.double() - old).abs().max()) if tensor.numel() else 0.0
        scale = float(old.abs().max()) or 1.0
        max_abs = max(max_abs, diff)
        if diff / scale > max_rel:
            max_rel, worst = diff / scale, name
    return {
        "same_plan": saved["plan"] == current["plan"],
        "same_groups_heads_channels": same_groups,
        "max_abs_weight_difference": max_abs,
        "max_relative_weight_difference": max_rel,
        "worst_tensor": worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="dense forwards timed (median taken)")
    parser.add_argument("--method", default="flattengpt", help="a registered method")
    parser.add_argument("--method-args", default="{}", help="method options as JSON, e.g. '{\"ridge_ratio\": 1}'")
    parser.add_argument("--save-weights", default=None)
    parser.add_argument("--compare-weights", default=None)
    parser.add_argument("--label", default="", help="free text stored in the JSON (e.g. the code version)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/cost_<model>.json")
    args = parser.parse_args()

    import torch

    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.calibration import build_calibration_batches

    torch.set_num_threads(args.threads)
    # The tokenizers' Rust pool takes as many threads as torch (read when it first encodes a batch of texts).
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    model, tokenizer = bundled.load_bundled(args.model, torch.float32)
    method_args = json.loads(args.method_args)
    config = FlattenConfig(
        method=args.method,
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        batch_size=args.batch_size,
        seed=0,
        **method_args,
    )
    batches = build_calibration_batches(tokenizer, config.calibration)
    forwards = dense_forward_seconds(model, batches, args.repeats)
    dense = statistics.median(forwards)

    quantizer = FlattenQuantizer(config, progress=False)
    start = time.perf_counter()
    quantizer.compress(model, tokenizer)
    compress_seconds = time.perf_counter() - start
    report = quantizer.report
    groups = [
        {k: g[k] for k in ("members", "kept_kv_groups", "kept_channels_per_member")} for g in report.get("groups", [])
    ]
    current = {
        "plan": report["plan_summary"],
        "groups": groups,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    result = {
        **cpu_run_header(args, model, report),
        "protocol": {
            "dense_forward": f"full model (embeddings to logits), no cache, median of {args.repeats} after a warm-up",
            "compression": f"{args.method} defaults + {method_args}, {args.num_layers_to_remove} layers removed, "
            "timed once",
            "label": args.label,
        },
        **cost_fields(dense, forwards, compress_seconds, report),
        "groups": groups,
    }
    if args.compare_weights:
        result["compared_with"] = {"file": args.compare_weights, **compare(torch.load(args.compare_weights), current)}
    if args.save_weights:
        torch.save(current, args.save_weights)
    suffix = "" if args.method == "flattengpt" else f"_{args.method}"
    out = Path(args.out or f"benchmarks/results/cost_{args.model}{suffix}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    phases = json.dumps({k: round(v, 2) for k, v in report["timings_seconds"].items()})
    print(
        f"dense forward {dense:.2f} s, compression {compress_seconds:.2f} s = "
        f"{result['compress_in_dense_forwards']:.2f} dense forwards; phases {phases}; "
        f"wrote {out}"
    )


if __name__ == "__main__":
    main()
