"""Feed-forward sublayer merging: adjacent layers share one permutation-aligned, averaged MLP (no layer removed).

Prints the windows chosen, the unique parameters before and after tying, and checks that the saved checkpoint
reloads with plain transformers and that `retie_ffn_` shares the MLPs in memory again.

python examples/ffn_merge/llama_example.py [--tiny]
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.methods.ffn_merge import retie_ffn_
from optimum_flatten.utils.torch_utils import count_parameters


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    sizes.pop("num_layers_to_remove")  # ffn_merge keeps every layer; its own options set what is shared
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    config = FlattenConfig(method="ffn_merge", window_size=2, num_windows=2, dataset=dataset, **sizes)
    quantizer = FlattenQuantizer(config)
    quantizer.compress(model, tokenizer)
    print("plan:", [g["layers"] for g in quantizer.report["ffn_groups"]], "share their MLPs")
    print(f"unique parameters: {quantizer.report['parameters_before']:,} -> {count_parameters(model):,}")

    with tempfile.TemporaryDirectory() as tmp:
        saved = quantizer.save(model, Path(tmp) / "merged", tokenizer)
        reloaded = AutoModelForCausalLM.from_pretrained(saved).eval()
        print(f"reloaded with plain transformers: {count_parameters(reloaded):,} parameters (untied on disk)")
        retie_ffn_(reloaded, json.loads((saved / "flatten_report.json").read_text()))
        print(f"after retie_ffn_: {count_parameters(reloaded):,}")
        ids = tokenizer("The state of the union is strong", return_tensors="pt").input_ids
        with torch.no_grad():
            equal = torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5)
        print("logits equal:", equal)
        if not equal:
            sys.exit("the reloaded model differs from the compressed one")


if __name__ == "__main__":
    main()
