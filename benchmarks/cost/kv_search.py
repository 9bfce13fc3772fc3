"""FlattenGPT's greedy KV-group search (`head_selection="reconstruction"` beyond 4,096 subsets), three ways on the same
statistics: one factorisation for the whole search, downdated after each drop (`ops.block_elimination`, the code since
2026-11-27); one factorisation a step (a new factorisation and inverse of the kept channels each step, scored as the
code scores; the code from 2026-11-26); one refit per candidate subset (`ridge_target_error` on each, as the search did
before 2026-11-26; `--skip-per-candidate` leaves it out).

Protocol: a merged pair of an MHA model, `--heads` heads of `--head-dim` channels a member (so 2·heads KV groups,
heads kept) and hidden size `--hidden`; the statistics are those of random token matrices (`--tokens` tokens: the
o_proj input a, mixed so its channels correlate, and a target t correlated with a W), float64, the sequential
target's form (S = E[a tᵀ], E‖t‖²). Each search runs once, timed with `time.perf_counter` (on CUDA, synchronised);
they must keep the same groups. LLaMA-2-7B is 32 heads of 128 channels, hidden 4096: the per-candidate search
took about 50 s a pair on an H200 there; on 2 CPU cores this runs reduced shapes.

Usage: python -m benchmarks.cost.kv_search [--heads 16] [--head-dim 64] [--hidden 1024] [--skip-per-candidate]
       [--out FILE] [--label L]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kv_search.json"


def statistics(heads: int, head_dim: int, hidden: int, tokens: int, device: torch.device, seed: int = 0):
    """(C, S, E‖t‖², W) of one merged pair's o_proj input and a target, float64."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = 2 * heads * head_dim
    mixing = torch.randn(width, width, generator=g, dtype=torch.float64) / width**0.5
    a = (torch.randn(tokens, width, generator=g, dtype=torch.float64) @ mixing).to(device)
    rows = (torch.randn(width, hidden, generator=g, dtype=torch.float64) / width**0.5).to(device)
    t = a @ rows + 0.5 * torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(device)
    return a.T @ a / tokens, a.T @ t / tokens, float(t.square().sum()) / tokens, rows


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-per-candidate", action="store_true", help="leave out the slowest search")
    parser.add_argument("--label", default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    from optimum_flatten.adapters import HeadGeometry
    from optimum_flatten.methods.flattengpt import select_kv_groups_by_reconstruction
    from optimum_flatten.ops.block_elimination import KeptRefit
    from optimum_flatten.ops.ridge import default_ridge_lambda, ridge_target_error

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    c, s, energy, rows = statistics(args.heads, args.head_dim, args.hidden, args.tokens, device)
    geometry = HeadGeometry(
        num_heads=2 * args.heads, num_kv_heads=2 * args.heads, head_dim=args.head_dim, hidden_size=args.hidden
    )
    lam = default_ridge_lambda(c, 1.0)  # attention_ridge_ratio's default

    def one_refit_per_candidate() -> list[int]:
        def error(groups: list[int]) -> float:
            channels = torch.tensor(geometry.head_channels(geometry.query_heads_of(groups)))
            return ridge_target_error(c, s, energy, rows, channels, lam)

        kept = list(range(geometry.num_kv_heads))
        while len(kept) > args.heads:
            kept = min(([k for k in kept if k != drop] for drop in kept), key=error)
        return kept

    def one_factorisation_a_step() -> list[int]:
        blocks = {
            g: torch.tensor(geometry.head_channels(geometry.query_heads_of([g]))) for g in range(geometry.num_kv_heads)
        }
        kept = list(blocks)
        while len(kept) > args.heads:
            refit = KeptRefit.fit(c, s, rows, [blocks[g] for g in kept], lam)  # a new factorisation every step
            del kept[int(torch.argmin(refit.removal_errors(energy, lam)))]
        return kept

    searches = {
        "one_factorisation_downdated": lambda: select_kv_groups_by_reconstruction(
            c, rows, geometry, args.heads, lam, (s, energy)
        ),
        "one_factorisation_a_step": one_factorisation_a_step,
    }
    if not args.skip_per_candidate:
        searches["one_refit_per_candidate"] = one_refit_per_candidate
    timings, kept = {}, {}
    for name, search in searches.items():
        synchronise(device)
        start = time.perf_counter()
        kept[name] = search()
        synchronise(device)
        timings[name] = time.perf_counter() - start
        print(f"{name}: {timings[name]:.2f} s", flush=True)
    groups = 2 * args.heads
    result = {
        "label": args.label or f"{args.heads} heads of {args.head_dim} a member, hidden {args.hidden}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "dtype": "float64",
        "threads": args.threads,
        "shapes": {
            "kv_groups": groups,
            "kept": args.heads,
            "channels_per_group": args.head_dim,
            "o_proj_input_width": groups * args.head_dim,
            "hidden": args.hidden,
            "statistics_tokens": args.tokens,
        },
        "factorisations": {
            "one_factorisation_downdated": 1,
            "one_factorisation_a_step": groups - args.heads,
            "one_refit_per_candidate": sum(range(args.heads + 1, groups + 1)),
        },
        "seconds": timings,
        "same_groups": all(k == kept["one_factorisation_downdated"] for k in kept.values()),
        "protocol": "one run each, perf_counter (synchronised on CUDA); random statistics, sequential-target form",
    }
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else {}
    runs[result["label"]] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
