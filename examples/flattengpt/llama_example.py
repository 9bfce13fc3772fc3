"""FlattenGPT with the explicit quantizer: compress, read the report, save a plain checkpoint, reload it.

python examples/flattengpt/llama_example.py [--tiny]
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    quantizer = FlattenQuantizer(FlattenConfig(method="flattengpt", dataset=dataset, seed=0, **sizes))
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
        ids = tokenizer("the state of the union", return_tensors="pt").input_ids
        with torch.no_grad():
            same = torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-4)
        print(
            f"reloaded {type(reloaded).__name__} with {reloaded.config.num_hidden_layers} layers; logits equal: {same}"
        )
        print("files:", sorted(p.name for p in out.iterdir()))
        if not same:
            raise SystemExit("the reloaded model differs from the compressed one")


if __name__ == "__main__":
    main()
