"""Compression under a memory budget, compression cost in dense forward passes, and what 7B / 70B would need.

Protocol (every number printed is measured here, in this run, unless marked as extrapolated):
- model: a bundled model (`--model`, default Qwen2.5-0.5B = Qwen2.5-Coder-0.5B-Instruct, 24 layers), float32;
- method: FlattenGPT with its defaults, `--num-layers-to-remove` layers;
- calibration: State of the Union speeches before 2000, packed, `--nsamples` x `--seqlen` tokens in batches of
  `--batch-size`, seed 0;
- two runs, each in its own process so that ru_maxrss is that run's peak RSS:
  * in_memory: the whole model loaded, then one timed dense forward of the full model (embeddings to logits) and
    one timed pass through the decoder stack alone over the calibration tokens, then compression;
  * offloaded: loaded with a manual `device_map` that keeps modules in forward order (embeddings, final norm, LM
    head, decoder layers) in memory while they fit in `--budget-gb` of resident parameters and offloads the rest
    to disk (read lazily from the checkpoint's safetensors by accelerate); the resident bytes are counted after
    loading and after compression and the run fails if either exceeds the budget;
- equality: both runs save their compressed checkpoint; the plans, kept KV groups and channels must agree and
  every tensor is compared (max abs difference printed);
- extrapolation: the per-phase costs are split into layer forwards (scale with tokens x layer parameters),
  second-moment products (tokens x (2 d_int)^2) and solves ((2 d_int)^3), fitted on this run, and evaluated for
  LLaMA-2 7B and 70B shapes at the paper's 20% of layers.

Usage: python -m benchmarks.scale.run [--model qwen2.5-0.5b] [--budget-gb 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def resident_bytes(model) -> int:
    """Bytes of parameters and buffers that are not on the meta device (offloaded ones are)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "meta" and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def budget_device_map(path: Path, budget_bytes: int) -> dict[str, str]:
    """Modules in forward order (embeddings, final norm, LM head, then decoder layers) stay in memory while they
    fit the budget; the rest is offloaded to disk. The budget covers every resident parameter, the LM head too."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    modules = [(f"model.{name}", m) for name, m in skeleton.model.named_children() if name != "layers"]
    modules.append(("lm_head", skeleton.lm_head))
    modules += [(f"model.layers.{i}", layer) for i, layer in enumerate(skeleton.model.layers)]
    device_map, used, seen = {}, 0, set()
    for name, module in modules:
        size = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in seen)
        fits = used + size <= budget_bytes
        device_map[name] = "cpu" if fits else "disk"
        if fits:
            used += size
            seen.update(id(p) for p in module.parameters())
    return device_map


def run_one(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.adapters import get_adapter
    from optimum_flatten.calibration import LayerwiseRunner, build_calibration_batches

    torch.set_num_threads(args.threads)
    path = bundled.bundled_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = FlattenConfig(
        method="flattengpt",
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        batch_size=args.batch_size,
        seed=0,
        # FlattenGPT's defaults when the stored results were measured (before 2026-11-26), kept so they reproduce.
        attention_target="parallel",
        head_selection="importance",
        mlp_target="parallel",
    )
    result: dict = {"run": args.one, "threads": args.threads}
    start = time.perf_counter()
    if args.one == "offloaded":
        device_map = budget_device_map(path, int(args.budget_gb * GIB))
        offload = tempfile.mkdtemp(prefix="scale-offload-")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, device_map=device_map, offload_folder=offload
        )
        result["offloaded_to_disk"] = [k for k, v in device_map.items() if v == "disk"]
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    result["load_seconds"] = time.perf_counter() - start
    result["checkpoint_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    result["resident_bytes_after_load"] = resident_bytes(model)
    result["rss_after_load_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if args.one == "in_memory":
        batches = build_calibration_batches(tokenizer, config.calibration)
        with torch.no_grad():
            start = time.perf_counter()
            for batch in batches:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            result["dense_forward_seconds"] = time.perf_counter() - start
            adapter = get_adapter(model)
            runner = LayerwiseRunner(adapter, batches)
            current = runner.inputs
            start = time.perf_counter()
            for i, layer in enumerate(adapter.layers()):
                current = runner.run(layer, i, current)
            result["stack_forward_seconds"] = time.perf_counter() - start
            del runner, current

    quantizer = FlattenQuantizer(config, progress=False)
    start = time.perf_counter()
    quantizer.compress(model, tokenizer)
    result["compress_seconds"] = time.perf_counter() - start
    result["timings"] = quantizer.report["timings_seconds"]
    result["plan"] = quantizer.report["plan_summary"]
    result["groups"] = [
        {k: g[k] for k in ("members", "kept_kv_groups", "kept_channels_per_member")} for g in quantizer.report["groups"]
    ]
    result["calibration_tokens"] = quantizer.report["calibration"]["tokens"]
    result["resident_bytes_after_compress"] = resident_bytes(model)
    if args.one == "offloaded":
        budget = int(args.budget_gb * GIB)
        for key in ("resident_bytes_after_load", "resident_bytes_after_compress"):
            if result[key] > budget:
                raise RuntimeError(f"{key}={result[key]} exceeds the budget of {budget} bytes")
    start = time.perf_counter()
    quantizer.save(model, args.save_dir, tokenizer)
    result["save_seconds"] = time.perf_counter() - start
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["config"] = {
        k: getattr(model.config, k)
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    }
    result["layers_before"] = quantizer.report["num_layers_before"]
    return result


def compare_checkpoints(a: Path, b: Path) -> float:
    """Max abs difference over all tensors of two saved checkpoints (they must hold the same names and shapes)."""
    from safetensors.torch import load_file

    first, second = {}, {}
    for f in sorted(a.glob("*.safetensors")):
        first.update(load_file(f))
    for f in sorted(b.glob("*.safetensors")):
        second.update(load_file(f))
    if set(first) != set(second):
        raise AssertionError(f"different tensors: {sorted(set(first) ^ set(second))[:5]}")
    return max(float((first[k].double() - second[k].double()).abs().max()) for k in first)


# LLaMA-2 shapes (the paper's models); GQA in 70B.
EXTRAPOLATE = {
    "LLaMA-2 7B": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, remove=6),
    "LLaMA-2 70B": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, remove=16),
}


def layer_matmul_params(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    head_dim = hidden // heads
    return 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate


def extrapolate(measured: dict, tokens: int) -> dict:
    """Time and memory of FlattenGPT on bigger shapes, from costs fitted on the measured run (same machine).

    Model: a layer forward costs `per_layer_token` x tokens x matmul parameters (fitted on the timed stack pass);
    FlattenGPT runs 2L + 4r of them (similarity pass, propagation pass, two runs of each double-width block); the
    second-moment products cost tokens x (w² + w_o²) per group (w = 2 d_int, w_o = 2 x hidden for the attention
    refit), fitted on the covariance time minus its forward part; the solves cost w³ + w_o³ per group, fitted on
    the solve time. Attention's token-pair cost is ignored (short calibration sequences).
    """
    cfg = measured["config"]
    layers, groups, measured_tokens = measured["layers_before"], len(measured["groups"]), measured["calibration_tokens"]
    p_measured = layer_matmul_params(
        cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    )
    per_layer_token = measured["stack_forward_seconds"] / (layers * measured_tokens * p_measured)
    w, w_o = 2 * cfg["intermediate_size"], 2 * cfg["hidden_size"]
    t = measured["timings"]
    covariance_forward = 2 * groups * measured_tokens * p_measured * per_layer_token
    product_rate = max(t["covariance"] - covariance_forward, 0.0) / (groups * measured_tokens * (w**2 + w_o**2))
    solve_rate = t["solve"] / (groups * (w**3 + w_o**3))
    out = {}
    for name, s in EXTRAPOLATE.items():
        p = layer_matmul_params(s["hidden"], s["intermediate"], s["heads"], s["kv_heads"])
        w, w_o, r = 2 * s["intermediate"], 2 * s["hidden"], s["remove"]
        layer_forward = per_layer_token * tokens * p
        forwards = (2 * s["layers"] + 4 * r) * layer_forward
        products = product_rate * r * tokens * (w**2 + w_o**2)
        solves = solve_rate * r * (w**3 + w_o**3)
        total = forwards + products + solves
        out[name] = {
            "layers": f"{s['layers']} -> {s['layers'] - r}",
            "hours_on_this_machine": round(total / 3600, 1),
            "in_dense_stack_forwards": round(total / (s["layers"] * layer_forward), 1),
            "share_forwards_products_solves": [round(x / total, 2) for x in (forwards, products, solves)],
            "weights_fp16_gb": round(s["layers"] * p * 2 / GIB, 1),
            "peak_workspace_gb": round(
                (
                    3 * p * 2  # one onloaded layer and the double-width block, float16
                    + 2 * w * w * 8  # C of the double-width MLP and its Cholesky factor, float64
                    + 4 * tokens * s["hidden"] * 2  # calibration states (inputs, current, outputs, one band copy)
                )
                / GIB,
                1,
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=["smollm2", "qwen2.5-0.5b"])
    parser.add_argument("--num-layers-to-remove", type=int, default=5)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--budget-gb", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extrapolate-tokens", type=int, default=128 * 2048, help="the paper's calibration")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/scale_<model>.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    work = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    runs = {}
    try:
        for name in ("in_memory", "offloaded"):
            command = [sys.executable, "-m", "benchmarks.scale.run", "--one", name, "--save-dir", str(work / name)] + [
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k not in ("one", "out", "save_dir") and v is not None
            ]
            completed = subprocess.run(command, capture_output=True, text=True)
            if completed.returncode != 0:
                sys.exit(f"{name} failed:\n{completed.stderr[-3000:]}")
            runs[name] = json.loads(completed.stdout.strip().splitlines()[-1])
            print(f"{name}: {runs[name]['compress_seconds']:.0f} s, peak RSS {runs[name]['peak_rss_mb']:.0f} MB")
        max_diff = compare_checkpoints(work / "in_memory", work / "offloaded")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = runs["in_memory"]["groups"] == runs["offloaded"]["groups"]
    result = {
        "protocol": {
            "model": args.model,
            "method": "flattengpt (attention_target='parallel', head_selection='importance', mlp_target='parallel': "
            "the defaults before 2026-11-26)",
            "num_layers_to_remove": args.num_layers_to_remove,
            "calibration": f"SOTU before 2000, packed, {args.nsamples} x {args.seqlen} tokens, batches of "
            f"{args.batch_size}, seed 0",
            "budget_gb": args.budget_gb,
            "threads": args.threads,
            "extrapolation_tokens": args.extrapolate_tokens,
        },
        "runs": runs,
        "same_groups_heads_channels": same,
        "max_abs_weight_difference": max_diff,
        "extrapolated": extrapolate(runs["in_memory"], args.extrapolate_tokens),
    }
    out = Path(args.out or f"benchmarks/results/scale_{args.model}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"same groups/heads/channels: {same}; max abs weight difference {max_diff:.3g}; wrote {out}")


if __name__ == "__main__":
    main()
