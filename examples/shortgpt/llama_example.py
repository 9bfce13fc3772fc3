"""ShortGPT baseline: drop the layers with the lowest Block Influence, on the same calibration as FlattenGPT.

python examples/shortgpt/llama_example.py --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from optimum_flatten import FlattenConfig, FlattenQuantizer

_spec = importlib.util.spec_from_file_location(
    "flattengpt_example", Path(__file__).resolve().parents[1] / "flattengpt" / "llama_example.py"
)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    model, tokenizer, dataset, sizes = _example.tiny_model_and_data() if args.tiny else _example.real_model_and_data()
    quantizer = FlattenQuantizer(FlattenConfig(method="shortgpt", dataset=dataset, **sizes))
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    print("block influence:", [round(s, 4) for s in quantizer.report["block_influence"]])


if __name__ == "__main__":
    main()
