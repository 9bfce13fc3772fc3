"""sliding_window on a LLaMA-family model, with the same calibration and export as every other method.

python examples/sliding_window/llama_example.py [--tiny]
"""

import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint, parse

from optimum_flatten import FlattenConfig, FlattenQuantizer


def main() -> None:
    args = parse(__doc__)
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    quantizer = FlattenQuantizer(FlattenConfig(method="sliding_window", dataset=dataset, **sizes))
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    print("timings (s):", quantizer.report["timings_seconds"])


if __name__ == "__main__":
    main()
