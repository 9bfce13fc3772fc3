"""benchmarks/cost/gpu_shape.py runs where CI runs: its tiny shape on the CPU, so the GPU benchmark does not rot
between the sessions that have a GPU (its numbers come only from a GPU: benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: The scripts run as modules of the benchmarks package, from the repository root, as on the device.
ROOT = Path(__file__).resolve().parents[1]


def test_tiny_shape_on_the_cpu_writes_cost_estimate_and_prefill(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--nsamples", "8", "--seqlen", "32"]
    args += ["--num-layers-to-remove", "2", "--repeats", "1", "--prefill", "--prefill-length", "16"]
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.cost.gpu_shape", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["plan"].startswith("6 -> 4 layers")
    assert result["shapes"]["tokens"] == 8 * 32
    assert result["compress_in_dense_forwards"] > 0 and result["stack_passes"] > 0
    assert result["estimate"]["method"] == "flattengpt" and result["estimate"]["workspace_bytes"]["peak"] > 0
    assert result["memory"] == {}  # accelerator memory is measured on CUDA only
    assert result["prefill"]["compressed"]["tokens_per_second"] > 0


def test_the_session_driver_reads_the_host_copy_probe_back_into_its_summary(tmp_path):
    """gpu_session.py's host-copy step at the tiny CPU shape: the probe's figures land in session.json (the device
    returns 8 files at most, so the probe writes none of its own under the output folder)."""
    driver = [sys.executable, "-m", "benchmarks.cost.gpu_session"]
    completed = subprocess.run(
        [*driver, "--tiny", "--rows", "host_copy", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    step = json.loads((tmp_path / "session.json").read_text())["host_copy"]
    assert step["status"] == "ok", (tmp_path / "session.log").read_text()[-2000:]
    assert step["result"]["pinned"] is False and step["result"]["copy_seconds"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.json", "session.log"]
