"""Quality against depth: perplexity ratio to dense vs layers removed, one line per method, in and out of domain.

Usage:
    python -m benchmarks.depth.curve run  [--model smollm2] [--removed 4,8,10] [--eval-tokens 16384] [--threads 2]
    python -m benchmarks.depth.curve plot [--model smollm2]

`run` calls run.py once per depth with the curve's variants (same calibration, evaluation and protocol as the main
table; results in benchmarks/results/curve_<model>_<N>.json, resumable). The main table's JSON
(benchmarks/results/quality_<model>.json) gives the point at its own depth. `plot` reads every JSON of the model and
draws benchmarks/results/curve_<model>.png (two panels: SOTU from 2000 on, King James Bible), and prints the
numbers it drew; RESULTS.md takes its table from `render.py`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: The methods the quality issue asks for on the curve (run.py's variant names).
CURVE_VARIANTS = (
    "shortgpt",
    "sleb_first_2_sequences",
    "uidl",
    "replaceme",
    "flattengpt",
    # FlattenGPT's defaults before 2026-11-26 (the paper's targets and head selection), and with the sequential
    # attention target alone (the first of that day's two changes), beside today's.
    "flattengpt_parallel_target",
    "flattengpt_parallel_mlp",
    "auto",
    # ReplaceMe with the down projection refitted (estimator="lstsq_down"), and auto with it among its candidates.
    "replaceme_lstsq_down",
    "auto_down",
)
RESULTS = Path(__file__).resolve().parents[1] / "results"


def curve_files(model: str) -> dict[int, Path]:
    """Layers removed -> JSON file holding that depth's rows (the main table included)."""
    files: dict[int, Path] = {}
    main = RESULTS / f"quality_{model}.json"
    if main.exists():
        files[int(json.loads(main.read_text()).get("protocol", {}).get("num_layers_to_remove", 6))] = main
    for path in sorted(RESULTS.glob(f"curve_{model}_*.json")):
        files[int(path.stem.rsplit("_", 1)[1])] = path
    return files


def curve_points(model: str) -> dict[str, dict[int, tuple[float, float]]]:
    """variant -> removed -> (ratio SOTU>=2000, ratio KJV), over the curve's variants that were measured."""
    points: dict[str, dict[int, tuple[float, float]]] = {}
    for removed, path in sorted(curve_files(model).items()):
        results = json.loads(path.read_text())["results"]
        dense = next(r for r in results if r["variant"] == "dense")
        for row in results:
            if row["variant"] in CURVE_VARIANTS and "error" not in row and row.get("perplexity_kjv"):
                points.setdefault(row["variant"], {})[removed] = (
                    row["perplexity"] / dense["perplexity"],
                    row["perplexity_kjv"] / dense["perplexity_kjv"],
                )
    return points


def plot(model: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    points = curve_points(model)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    titles = ("SOTU from 2000 on (in domain)", "King James Bible (out of domain)")
    for panel, (axis, title) in enumerate(zip(axes, titles, strict=True)):
        for variant in CURVE_VARIANTS:
            if variant not in points:
                continue
            xs = sorted(points[variant])
            axis.plot(xs, [points[variant][x][panel] for x in xs], marker="o", label=variant)
        axis.set_title(title)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("layers removed")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("perplexity / dense perplexity")
    axes[1].legend(fontsize=8)
    figure.suptitle(f"{model}: calibration 32 x 512 tokens of SOTU before 2000; ratio to dense (lower is better)")
    figure.tight_layout()
    out = RESULTS / f"curve_{model}.png"
    figure.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "plot"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--removed", default="4,8,10", help="depths to run (the main table gives its own)")
    parser.add_argument("--variants", default=",".join(CURVE_VARIANTS))
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.action == "plot":
        print(plot(args.model))
        for variant, by_depth in curve_points(args.model).items():
            print(variant, {n: tuple(round(v, 3) for v in ratios) for n, ratios in sorted(by_depth.items())})
        return
    for removed in (int(n) for n in args.removed.split(",")):
        command = [
            sys.executable,
            "-m",
            "benchmarks.depth.run",
            f"--model={args.model}",
            f"--num-layers-to-remove={removed}",
            f"--variants={args.variants}",
            f"--eval-tokens={args.eval_tokens}",
            f"--threads={args.threads}",
            f"--out={RESULTS / f'curve_{args.model}_{removed}.json'}",
            "--resume",
        ]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
