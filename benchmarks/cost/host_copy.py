"""Can a GPU keep ReplaceMe's window of calibration states in host memory for free? The measurement before the code.

Issue 31 asks ReplaceMe for at most 1.5 dense forwards at LLaMA-2-7B's shape *and* a workspace under 6 GiB. Holding
the states around the best block on the device gives 1.18x at 23 GiB; streaming them gives 7.2 GiB at 2.16x (the fit
walks the stack a second time). Holding the window in pinned host memory instead would give both only if copying each
boundary's states out (2 GiB at 128 x 2048 tokens x 4096 channels in bfloat16) overlaps the next layer's compute
almost entirely, and if pinning that much host memory is cheap. This measures exactly that, on random data:

- ``pin_seconds``: allocating `--gib` of pinned host memory (once per window slot);
- ``copy_seconds`` (pinned) and ``pageable_copy_seconds``: one device-to-host copy of `--gib`, synchronised;
- ``compute_seconds``: bfloat16 products standing in for one decoder layer over the same tokens (4 products of
  ``tokens x hidden`` by ``hidden x hidden`` and 3 by the MLP width, `--tokens` rows at a time);
- ``overlapped_seconds``: the same compute while the copy runs on a side stream, both waited for;
- ``hidden_share``: how much of the copy the compute hid, (compute + copy - overlapped) / copy (1 = free).

The window is 7 + 2 boundaries at 7 removed: 18 GiB of pinned host memory for the run. On the CPU (`--device cpu`,
no pinning, the copy a clone) it runs at any size, which is how the script is checked before a device session:
``PYTHONPATH=src python -m benchmarks.cost.host_copy --device cpu --gib 0.01 --hidden 64 --intermediate 172
--tokens 256``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from optimum_flatten.utils.torch_utils import synchronize


def _timed(device: torch.device, work):
    """(what `work()` returns, its seconds with the device synchronised at both ends)."""
    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gib", type=float, default=2.0, help="one boundary's states (128 x 2048 x 4096 bf16: 2)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--tokens", type=int, default=16384, help="rows per product")
    parser.add_argument("--total-tokens", type=int, default=262144, help="tokens of one layer's pass")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    elements = int(args.gib * 2**30) // 2
    pinned = device.type == "cuda"

    states = torch.randn(elements, device=device, dtype=torch.float32).to(dtype)
    host, pin_seconds = _timed(device, lambda: torch.empty(elements, dtype=dtype, pin_memory=pinned))
    pageable = torch.empty(elements, dtype=dtype)
    _, copy_seconds = _timed(device, lambda: host.copy_(states, non_blocking=pinned))
    _, pageable_seconds = _timed(device, lambda: pageable.copy_(states))

    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    square = torch.randn(args.hidden, args.hidden, device=device, dtype=dtype) / args.hidden**0.5
    wide = torch.randn(args.hidden, args.intermediate, device=device, dtype=dtype) / args.hidden**0.5
    narrow = torch.randn(args.intermediate, args.hidden, device=device, dtype=dtype) / args.intermediate**0.5
    repeats = max(1, args.total_tokens // args.tokens)

    def layer() -> None:
        for _ in range(repeats):
            for _ in range(4):  # q, k, v, o
                x @ square
            up = x @ wide
            gate = x @ wide
            (up * gate) @ narrow

    layer()  # warm-up
    _, compute_seconds = _timed(device, layer)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def overlapped() -> None:
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                host.copy_(states, non_blocking=True)
        else:
            host.copy_(states)
        layer()

    _, overlapped_seconds = _timed(device, overlapped)
    hidden = (compute_seconds + copy_seconds - overlapped_seconds) / copy_seconds
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "gib": args.gib,
        "shapes": {"hidden": args.hidden, "intermediate": args.intermediate, "tokens": args.total_tokens},
        "pinned": pinned,
        "pin_seconds": pin_seconds,
        "copy_seconds": copy_seconds,
        "copy_gb_per_s": args.gib * 2**30 / 1e9 / copy_seconds,
        "pageable_copy_seconds": pageable_seconds,
        "compute_seconds": compute_seconds,
        "overlapped_seconds": overlapped_seconds,
        "hidden_share": hidden,
        "protocol": "random bfloat16; each figure one synchronised run after a warm-up of the compute",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
