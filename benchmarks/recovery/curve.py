"""Draws healing's ratio to dense against training tokens, one line per mode and loss, from the JSON files of
benchmarks/recovery/run.py (benchmarks/results/recovery_<model>_<method>_<mode>_<kd|lm>_<tokens>.json).

Each run is one point at its budget; every line starts at 0 tokens from the untrained model its runs share (the
same compression, calibration and evaluation tokens). Two panels: the speeches from 2000 on (in domain) and the King
James Bible (out of domain). Nothing is run here.

Usage: python -m benchmarks.recovery.curve [--model smollm2] [--method flattengpt]
Writes benchmarks/results/recovery_<model>_<method>.png and prints the points it drew.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from pathlib import Path

from benchmarks.recovery import protocol  # run.py's default: a run scored or trained otherwise is a line of its own

RESULTS = Path(__file__).resolve().parents[1] / "results"

TEXTS = (("sotu_from_2000", "SOTU from 2000 on (in domain)"), ("bible_kjv", "King James Bible (out of domain)"))


def _runs(model: str, method: str) -> list[dict]:
    """The healing runs of `method` on `model` in the results folder, in file-name order."""
    runs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob(f"recovery_{model}_{method}_*_*.json"))]
    return [run for run in runs if run.get("method") == method and "healed" in run]


def healing_points(model: str, method: str) -> dict[str, dict[int, tuple[float, float]]]:
    """'mode, loss' -> training tokens -> (ratio in domain, ratio out of domain), 0 tokens being the untrained
    model. A local run with another state loss than the pooled one, or with a global phase (a line per split of
    the budget between the phases, and per global rate given by hand) or with other training rows than run.py's
    default rows (`protocol.py`), or from another calibration (`--own-text`, `--calibration`: another untrained
    model), is a line of its own,
    and so is a run scored on another number of evaluation tokens (its ratios, the untrained one included, are of
    other tokens: drawn on the same line, the last file of a budget would replace the other's point).
    Runs of another method, named like the run script's files but of another shape, or with a global phase from
    before it had a rate of its own (it took the local one; the table has it), are skipped."""
    points: dict[str, dict[int, tuple[float, float]]] = {}
    runs: list[tuple[str, int, float, dict]] = []
    for run in _runs(model, method):
        recovery = run.get("recovery", {})
        state = recovery.get("state_loss")
        phase = recovery.get("global_phase")
        if phase and "learning_rate" not in phase:
            continue
        mode = run["mode"] + (f" ({state} state loss)" if state not in (None, "pooled") else "")
        if phase:  # runs splitting their budget otherwise between the phases are lines of their own
            total, global_tokens = int(recovery["tokens_trained"]), int(phase["tokens_trained"])
            share = Fraction(total - global_tokens, global_tokens)
            every = " of every weight" if phase.get("trained") == "every parameter" else ""
            mode += f" then global{every} (local:global {share.numerator}:{share.denominator})"
            given = run.get("settings", {}).get("global_learning_rate")
            mode += f" at lr {given:g}" if given is not None else ""  # a global rate given by hand: its own line
        settings = run.get("settings", {})
        if protocol.seed(settings) != protocol.SEED or protocol.frozen_embeddings(settings):
            continue  # another healing seed, or the embeddings frozen: checks in the notebook, not points of a line
        if not protocol.default_loss(settings):
            continue  # hidden-state terms, a temperature or a mix of the LM loss: the notebook's, not the curve's
        rows = protocol.training_rows(settings)
        mode += f", rows {rows['seqlen']} × {rows['batch_size']}" if rows != protocol.TRAINING_ROWS else ""
        mode += f", on {text}" if (text := protocol.healing_text(settings)) else ""  # one line per healing text
        mode += f", from {start}" if (start := protocol.calibration(settings)) else ""  # another untrained model
        mode += f", {optim}" if (optim := protocol.optimiser(settings)) else ""
        default_tokens = protocol.EVAL_TOKENS[model]
        scored = int(run.get("eval_tokens", default_tokens))
        scored_on = f" ({scored // 1024}K evaluation tokens)" if scored != default_tokens else ""
        tokens, rate = int(run["recovery"]["tokens_trained"]), float(run["recovery"]["learning_rate"])
        runs.append((f"{mode}, {run['loss']}{scored_on}", tokens, rate, run))
    # Where two runs of a line share a budget at different rates (a default rate that changed since, or a rate given
    # by hand), each rate is a line of its own: otherwise the file sorted last would silently replace the other.
    rates: dict[tuple[str, int], set[str]] = {}
    for label, tokens, rate, _ in runs:
        rates.setdefault((label, tokens), set()).add(f"{rate:.2g}")
    split = {label for (label, _), seen in rates.items() if len(seen) > 1}
    for label, tokens, rate, run in runs:
        line = points.setdefault(f"{label} at lr {rate:.2g}" if label in split else label, {})
        line[0] = tuple(run["untrained"][text]["ppl_ratio"] for text, _ in TEXTS)
        line[tokens] = tuple(run["healed"][text]["ppl_ratio"] for text, _ in TEXTS)
    return points


def plot(model: str, method: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = healing_points(model, method)
    if not points:
        raise SystemExit(f"no healing runs of {method} on {model} in {RESULTS}")
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for panel, (axis, (_, title)) in enumerate(zip(axes, TEXTS, strict=True)):
        for k, (label, line) in enumerate(sorted(points.items())):  # tab20: one colour a line past ten lines
            xs = sorted(line)
            color = plt.get_cmap("tab20")(k % 20)
            axis.plot([x / 1024 for x in xs], [line[x][panel] for x in xs], marker="o", label=label, color=color)
        axis.set_title(title)
        axis.set_xlabel("training tokens (K)")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("perplexity / dense perplexity")
    # Beside the panels, not over them: with a dozen lines a legend inside hides the points it names.
    handles, labels = axes[1].get_legend_handles_labels()
    plans = {run["plan"] for run in _runs(model, method)}
    removed = next(iter(plans)).split(";")[0] if len(plans) == 1 else "plans differ"  # e.g. "30 -> 24 layers"
    figure.suptitle(f"{model}, {method} ({removed}), healed on pre-2000 speeches outside calibration unless named")
    figure.tight_layout()
    figure.legend(
        handles, labels, fontsize=8, title="what is trained, loss", loc="center left", bbox_to_anchor=(1, 0.5)
    )
    out = RESULTS / f"recovery_{model}_{method}.png"
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--method", default="flattengpt")
    args = parser.parse_args()
    print(plot(args.model, args.method))
    for label, line in sorted(healing_points(args.model, args.method).items()):
        print(label, {tokens: tuple(round(v, 3) for v in ratios) for tokens, ratios in sorted(line.items())})


if __name__ == "__main__":
    main()
