"""Merges rows of separate run.py outputs into one table file, refusing runs measured under another protocol.

Usage: python -m benchmarks.depth.merge benchmarks/results/quality_smollm2.json /tmp/run_a.json /tmp/run_b.json

Variants run in separate processes (to use idle cores, or added later) are only comparable when the model, the
calibration windows, the evaluation windows and the depth are the same; the dense rows must also agree (the same
perplexities to 1e-6 relative: a run with another torch thread count sums the float32 logits in another order, which
moves the dense perplexity by about 1e-8, while any change of model, windows or tokens moves it by far more). A merged
row replaces a row of the same variant. Rows that failed are not merged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Protocol entries that must be equal for rows to share a table (speed's thread count may differ: it is per row).
SAME = ("model", "calibration", "evaluation", "out_of_domain", "num_layers_to_remove")


def merge(target: Path, sources: list[Path]) -> list[str]:
    data = json.loads(target.read_text())
    dense = next(r for r in data["results"] if r["variant"] == "dense")
    merged = []
    for source in sources:
        other = json.loads(source.read_text())
        if other.get("partial"):
            raise SystemExit(f"{source} is a partial run (it has no protocol yet); let it finish or use --resume.")
        for key in SAME:
            if data["protocol"].get(key) != other["protocol"].get(key):
                raise SystemExit(f"{source}: protocol {key!r} differs: {other['protocol'].get(key)!r}")
        other_dense = next(r for r in other["results"] if r["variant"] == "dense")
        for key in ("perplexity", "perplexity_kjv"):
            if abs(other_dense[key] / dense[key] - 1) > 1e-6:
                raise SystemExit(f"{source}: the dense {key} differs ({other_dense[key]} vs {dense[key]})")
        for row in other["results"]:
            if row["variant"] == "dense" or "error" in row:
                continue
            data["results"] = [r for r in data["results"] if r["variant"] != row["variant"]] + [row]
            merged.append(row["variant"])
    target.write_text(json.dumps(data, indent=2) + "\n")
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("sources", type=Path, nargs="+")
    args = parser.parse_args()
    print("merged:", ", ".join(merge(args.target, args.sources)))


if __name__ == "__main__":
    main()
