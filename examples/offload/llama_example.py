"""A model larger than memory: load it with layers offloaded to disk, compress, and get what in-memory gives.

Decoder layers beyond the first two are offloaded to disk (accelerate reads them lazily from the checkpoint's
safetensors); calibration onloads one layer at a time and merged blocks are offloaded again as soon as they are
built. The script then compresses the same checkpoint in memory and checks the two results are equal.

python examples/offload/llama_example.py [--tiny]
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer


def offloading_device_map(path: str, layers_in_memory: int = 2) -> dict[str, str]:
    """Everything but the decoder layers in memory, then `layers_in_memory` layers, the rest on disk."""
    config = AutoConfig.from_pretrained(path)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(config.num_hidden_layers):
        device_map[f"model.layers.{i}"] = "cpu" if i < layers_in_memory else "disk"
    return device_map


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = FlattenConfig(method="flattengpt", dataset=dataset, **sizes)

    with tempfile.TemporaryDirectory() as offload_folder:
        offloaded = AutoModelForCausalLM.from_pretrained(
            path, device_map=offloading_device_map(path), offload_folder=offload_folder
        ).eval()
        quantizer = FlattenQuantizer(config)
        quantizer.compress(offloaded, tokenizer)
        print("plan:", quantizer.report["plan_summary"])
        on_meta = sum(p.device.type == "meta" for p in offloaded.parameters())
        print(f"parameters still offloaded after compression: {on_meta}")

        in_memory = AutoModelForCausalLM.from_pretrained(path).eval()
        FlattenQuantizer(config, progress=False).compress(in_memory, tokenizer)
        ids = tokenizer("The state of the union is strong", return_tensors="pt").input_ids
        with torch.no_grad():
            difference = (offloaded(ids).logits - in_memory(ids).logits).abs().max().item()
        print(f"max logit difference, offloaded vs in-memory compression: {difference:.2e}")
        if difference > 1e-4:
            sys.exit("offloaded compression differs from in-memory compression")


if __name__ == "__main__":
    main()
