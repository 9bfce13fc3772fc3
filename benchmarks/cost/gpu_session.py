"""Everything a lent GPU session should measure for the cost tables, in one command of under 8 minutes.

Issue 31 asks for one prepared call: the `gpu`-marked tests, then `gpu_shape.py` for each row of the GPU cost table,
most wanted first, each in its own process with its own time limit (so one slow row loses only itself), each JSON
written to `--out-dir` as soon as it exists (a call cut short keeps what finished). The device returns at most 8 files,
so every step's output goes to one ``session.log`` (6 JSON files + the log + ``session.json``), and `--budget` caps
the whole call: a step gets at most what is left of it, so ``session.json`` is written before the device's limit.
Steps, most wanted first (`--rows` picks some; the files come back in this order of need):

1. ``replaceme``: ReplaceMe's defaults at LLaMA-2-7B, 7 of 32 removed: over the default budget for the window, the
   selection walks once batch by batch with the statistics of 4 shortlisted starts (estimated 1.25x one dense forward
   and 5.16 GiB; the report's ``one_pass`` says whether the block was on the shortlist);
2. ``heal``: `heal_shape.py`, what healing costs at LLaMA-2-7B shape: each mode's peak memory and training tokens a
   second with the teacher held, the mode the default picks on an 80 and a 141 GiB device, the footprint estimate
   against the measured rise, and the teacher's sampling speed from a random first token;
3. ``defaults``: FlattenGPT's defaults at the same shape, with the prefill speed-up;
4. ``replaceme_held``: ReplaceMe with ``held_states_gb=24`` (1.18-1.19x at 23 GiB on the H100 and the H200);
5. ``70b``: FlattenGPT's defaults at 70B widths, 4 layers built, one pair merged (the 40 GiB workspace goal);
6. ``profile``: FlattenGPT's defaults at LLaMA-2-7B widths, 8 layers built, 2 removed, under `torch.profiler`
   (diagnostic: where each phase's time goes on the device, the operators and the host synchronisations);

after the tests `host_copy.py` (``host_copy``: pinning 2 GiB of host memory, one device-to-host copy of it, and how
much of that copy a layer's worth of bfloat16 products hides; its figures go into ``session.json``), and at the end
`kv_search.py` at LLaMA-2-7B widths on the GPU (``kv_search``: FlattenGPT's KV-group search alone). Every step
together would bring back 9 files, one over the device's 8: a call names the rows it runs.

Protocol per row: `gpu_shape.py`'s (random bf16 weights, 128 × 2048 calibration tokens in batches of 8, one dense
forward after a warm-up, `--repeats 1` to save the session's minutes, per-phase peaks). Copy the JSON files into
benchmarks/results as ``cost_gpu_<shape>_<label>.json`` and run `python -m benchmarks.render --write`.

On a CPU the same driver runs at the tiny shape in seconds (``--tiny``), which is how it is checked before a
session: ``python -m benchmarks.cost.gpu_session --tiny --out-dir /tmp/gpu_session``.

Usage on the device (src on PYTHONPATH): ``python -m benchmarks.cost.gpu_session --out-dir "$OUT"``. The device's
image has no optimum, which `optimum_flatten.quantizer` imports: carry its wheel (here, once: ``pip download --no-deps
optimum==2.3.0 -d .whl``, ``.whl`` ignored by git; name ``.whl`` in the call's carry) and install it into a folder on
PYTHONPATH first (``pip install --no-index --no-deps --target /tmp/site .whl/*.whl``). The driver checks that import
before anything runs, so a call without it fails in a second instead of failing every row (it did on 2026-11-28).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The repository root: every step runs there, as ``python -m benchmarks.cost.<script>``, with its src on PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]

#: (label, gpu_shape.py arguments, seconds allowed), most wanted first (`HEAL` runs after the first of them).
ROWS: list[tuple[str, list[str], int]] = [
    ("replaceme", ["--shape", "llama-2-7b", "--num-layers-to-remove", "7", "--method", "replaceme"], 80),
    ("defaults", ["--shape", "llama-2-7b", "--num-layers-to-remove", "7", "--prefill"], 170),
    ("replaceme_held", ["--shape", "llama-2-7b", "--num-layers-to-remove", "7", "--method", "replaceme",
                        "--method-args", '{"held_states_gb": 24}'], 80),
    ("70b", ["--shape", "llama-2-70b", "--layers", "4", "--num-layers-to-remove", "1"], 100),
    ("profile", ["--shape", "llama-2-7b", "--layers", "8", "--num-layers-to-remove", "2", "--profile"], 100),
]  # fmt: skip
#: `heal_shape.py`'s step: (label, arguments, arguments at the tiny shape on the CPU, seconds allowed).
HEAL = ("heal", ["--shape", "llama-2-7b"], ["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
        "--num-layers-to-remove", "2", "--steps", "1", "--sample-seqlen", "32", "--modes", "full", "local"],
        220)  # fmt: skip


def run(command: list[str], limit: int, log: Path, title: str) -> dict:
    """Runs one step with a time limit; its output is appended to `log` under `title`; returns what happened."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with log.open("a") as out:
        out.write(f"\n===== {title} (limit {limit} s) =====\n")
        out.flush()
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=limit, env=env, cwd=ROOT)
            status = "ok" if code.returncode == 0 else f"exit {code.returncode}"
        except subprocess.TimeoutExpired:
            status = f"stopped after {limit} s"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), "log": log.name}


def remaining(limit: int, started: float, budget: float) -> int:
    """A step's limit within what is left of the whole call's budget (a few seconds kept to write the summary)."""
    return int(min(limit, budget - (time.perf_counter() - started) - 5))


def host_copy(tiny: bool, started: float, budget: float, log: Path) -> dict:
    """`host_copy.py`'s step: its JSON is read back into the step's entry (the device returns 8 files at most)."""
    shape = ["--device", "cpu", "--gib", "0.01", "--hidden", "64", "--intermediate", "172", "--tokens", "256"]
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "host_copy.json"
        command = [sys.executable, "-m", "benchmarks.cost.host_copy", *(shape if tiny else []), "--out", str(target)]
        step = run(command, remaining(40, started, budget), log, "host_copy")
        if target.exists():
            step["result"] = json.loads(target.read_text())
    return step


def heal(tiny: bool, started: float, budget: float, out: Path, log: Path) -> dict:
    """`heal_shape.py`'s step: each healing mode's peak and speed at 7B, the default's choice, the teacher's
    sampling speed (its JSON is written row by row, so a step cut short keeps the modes that finished)."""
    label, full_args, tiny_args, limit = HEAL
    allowed = remaining(limit, started, budget)
    if allowed < 30:
        return {"status": f"not run: {allowed} s of the budget left"}
    target = out / "heal_gpu_llama-2-7b.json" if not tiny else out / "heal_tiny.json"
    command = [sys.executable, "-m", "benchmarks.cost.heal_shape", *(tiny_args if tiny else full_args)]
    step = run([*command, "--out", str(target)], allowed, log, label)
    step["written"] = target.exists()
    return step


def _check_imports() -> None:
    """Stops at once when the project cannot be imported as every step will import it (the device lacks optimum)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    check = [sys.executable, "-c", "import optimum_flatten.quantizer"]
    found = subprocess.run(check, env=env, cwd=ROOT, capture_output=True, text=True)
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(f"optimum_flatten does not import here ({last}); carry the optimum wheel (see the docstring)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, to check the driver")
    parser.add_argument("--rows", nargs="+", default=None, help="labels of the rows to run (default: all)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole call")
    args = parser.parse_args()
    _check_imports()
    started = time.perf_counter()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "session.log"
    steps = {}
    if not args.skip_tests and not args.tiny:
        steps["gpu tests"] = run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
            remaining(90, started, args.budget),
            log,
            "gpu tests",
        )
        print("gpu tests:", steps["gpu tests"], flush=True)
    if not args.rows or "host_copy" in args.rows:
        steps["host_copy"] = host_copy(args.tiny, started, args.budget, log)
        print("host_copy:", steps["host_copy"], flush=True)
    for index, (label, row_args, limit) in enumerate(ROWS):
        if index == 1 and (not args.rows or HEAL[0] in args.rows):
            steps[HEAL[0]] = heal(args.tiny, started, args.budget, out, log)
            print(f"{HEAL[0]}:", steps[HEAL[0]], flush=True)
        if args.rows and label not in args.rows:
            continue
        row_args = list(row_args)
        if args.tiny:  # the same arguments at the tiny shape, on the CPU
            shape_at = row_args.index("--shape") + 1
            row_args[shape_at] = "tiny"
            removed_at = row_args.index("--num-layers-to-remove") + 1
            row_args[removed_at] = str(min(int(row_args[removed_at]), 2))  # the tiny shape has 6 layers
            if "--layers" in row_args:
                del row_args[row_args.index("--layers") : row_args.index("--layers") + 2]
            row_args += ["--device", "cpu", "--dtype", "float32", "--nsamples", "8", "--seqlen", "64"]
            row_args = [a for a in row_args if a != "--prefill"] + ["--prefill", "--prefill-length", "64"]
        else:
            row_args += ["--phase-peaks"]
        shape = row_args[row_args.index("--shape") + 1]
        target = out / f"cost_gpu_{shape}_{label}.json"
        command = [sys.executable, "-m", "benchmarks.cost.gpu_shape", *row_args, "--repeats", "1", "--label", label]
        allowed = remaining(limit, started, args.budget)
        if allowed < 30:
            steps[label] = {"status": f"not run: {allowed} s of the budget left"}
            print(f"{label}:", steps[label], flush=True)
            continue
        steps[label] = run([*command, "--out", str(target)], allowed, log, label)
        steps[label]["written"] = target.exists()
        print(f"{label}:", steps[label], flush=True)
    if not args.rows or "kv_search" in args.rows:  # the KV-group search alone at 7B widths, its removals' products
        shape = ["--heads", "4", "--head-dim", "16", "--hidden", "64", "--tokens", "512"] if args.tiny else [
            "--heads", "32", "--head-dim", "128", "--hidden", "4096", "--device", "cuda"]  # fmt: skip
        allowed = remaining(60, started, args.budget)
        target = out / "kv_search.json"
        if allowed < 20:
            steps["kv_search"] = {"status": f"not run: {allowed} s of the budget left"}
        else:
            command = [sys.executable, "-m", "benchmarks.cost.kv_search", *shape, "--skip-per-candidate"]
            steps["kv_search"] = run([*command, "--out", str(target)], allowed, log, "kv_search")
            steps["kv_search"]["written"] = target.exists()
        print("kv_search:", steps["kv_search"], flush=True)
    (out / "session.json").write_text(json.dumps(steps, indent=2) + "\n")


if __name__ == "__main__":
    main()
