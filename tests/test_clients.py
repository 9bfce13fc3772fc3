"""The "ordinary checkpoint" claim, tested in CI with the cheapest clients of benchmarks/clients/run.py.

A tiny compressed GPT-2 goes through transformers' pipeline in a fresh process (which never imports
optimum_flatten); it and a tiny Qwen2 whose MLPs ffn_merge tied (sliding window 16, generation well past it) go
through cached vs uncached greedy generation and a PEFT LoRA train -> save -> reload -> merge. The benchmark runs
the rest (accelerate offload, ONNX Runtime, torch.compile, transformers 4.x).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "clients" / "run.py"


@pytest.fixture(scope="module")
def clients():
    spec = importlib.util.spec_from_file_location("clients_benchmark", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def checkpoints(clients, tmp_path_factory):
    folder = tmp_path_factory.mktemp("clients")
    return {name: clients.compress_tiny(name, build, options, folder) for name, build, options in clients.TINY[1:]}


def _passed(row: dict) -> None:
    assert row["status"] == "ok", row
    assert row["passed"], row
    assert row["greedy_identical"] is not False, row


def test_pipeline_in_a_fresh_process_reads_the_checkpoint(clients, checkpoints):
    row = clients.run_check("pipeline_fresh_process", checkpoints["tiny-gpt2 flattengpt"])
    _passed(row)
    assert "optimum_flatten imported: False" in row["detail"]


@pytest.mark.parametrize("name", ["tiny-gpt2 flattengpt", "tiny-qwen2 ffn_merge"])
@pytest.mark.parametrize("client", ["generate_cached_vs_uncached", "peft_lora"])
def test_plain_reload_generates_and_takes_a_lora_like_the_model_in_memory(clients, checkpoints, name, client):
    row = clients.run_check(client, checkpoints[name])
    _passed(row)
    if name.startswith("tiny-qwen2") and client == "generate_cached_vs_uncached":
        assert "sliding window 16" in row["detail"]


def test_a_missing_client_is_skipped_with_its_reason_and_a_failing_one_says_why(clients, checkpoints, monkeypatch):
    checkpoint = checkpoints["tiny-gpt2 flattengpt"]

    def missing(ck, work):
        raise clients.Skipped("not installed here")

    def broken(ck, work):
        raise RuntimeError("cannot read the checkpoint")

    monkeypatch.setitem(clients.CHECKS, "missing", missing)
    monkeypatch.setitem(clients.CHECKS, "broken", broken)
    skipped = clients.run_check("missing", checkpoint)
    assert skipped["status"] == "skipped" and skipped["reason"] == "not installed here" and "passed" not in skipped
    failed = clients.run_check("broken", checkpoint)
    assert failed["status"] == "failed" and "passed" not in failed
    assert (failed["client"], failed["checkpoint"]) == ("broken", "tiny-gpt2 flattengpt")
    assert failed["error"] == "RuntimeError: cannot read the checkpoint"
