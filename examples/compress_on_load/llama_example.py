"""One line: compress while loading, through transformers' quantizer registry, then save a plain checkpoint.

python examples/compress_on_load/llama_example.py [--tiny]
"""

import json
import sys
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(path)

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FlattenConfig(dataset=dataset, tokenizer=tokenizer, **sizes)
    )
    print("plan:", model.flatten_report["plan_summary"])
    print("quantization_config left on the model:", getattr(model.config, "quantization_config", None))

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
        print(
            "saved config:",
            config["architectures"],
            config["num_hidden_layers"],
            "layers,",
            ("quantization_config" in config and "with") or "without",
            "quantization_config",
        )


if __name__ == "__main__":
    main()
