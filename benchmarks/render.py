"""Prints the markdown tables of benchmarks/RESULTS.md from the JSON files in benchmarks/results/.

Usage: python benchmarks/render.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def depth_table(path: Path) -> str:
    data = json.loads(path.read_text())
    results = data["results"]
    dense = next(r for r in results if r["variant"] == "dense")
    lines = [f"- {k}: {v}" for k, v in data.get("protocol", {}).items()]
    lines += [
        "",
        "| variant | layers | params (M) | perplexity | ppl / dense | compress s | stack passes | peak RSS MB | plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['layers']} | {r['parameters'] / 1e6:.1f} | {r['perplexity']:.2f} | "
            f"{r['perplexity'] / dense['perplexity']:.3f} | {r.get('compress_seconds', 0):.0f} | "
            f"{r.get('cost_stack_passes', '')} | {r['peak_rss_mb']:.0f} | {r.get('plan', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    for name in ("smollm2", "qwen2.5-0.5b"):
        path = RESULTS / f"{name}.json"
        if path.exists():
            print(f"### {name}\n\n{depth_table(path)}\n")
    for path in sorted(RESULTS.glob("speed_*.json")):
        d = json.loads(path.read_text())
        print(f"### speed {d['model']}: {d['layers'][0]} -> {d['layers'][1]} layers\n")
        print("| | dense tok/s | compressed tok/s | measured speed-up | ideal L/L' |\n|---|---|---|---|---|")
        for kind in ("prefill", "decode"):
            key = f"{kind}_tokens_per_second"
            print(
                f"| {kind} | {d['dense'][key]:.0f} | {d['compressed'][key]:.0f} | {d[f'{kind}_speedup']:.3f} | "
                f"{d['ideal_speedup']:.3f} |"
            )
        print(f"\nprotocol: {d['protocol']}\n")
    recovery = RESULTS / "recovery_smollm2.json"
    if recovery.exists():
        d = json.loads(recovery.read_text())
        print(f"### recovery\n\n{json.dumps({k: v for k, v in d.items() if k != 'loss_history'}, indent=2)}\n")


if __name__ == "__main__":
    main()
