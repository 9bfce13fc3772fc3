"""The command line's saves after a healing FSDP2 sharded across the ranks, on 2 CPU processes (gloo): the default
shards `full` where it fits no rank (`options.recovery.sharded_full`), and the healed model comes back as one shard
a rank. `recover` and ``compress --heal-tokens`` used to hand rank 0's shard to the save; they now gather the whole
weights on rank 0 (`recovery.unsharded`), and the checkpoint is the model one process trains on the same batches.
`fsdp_cli.py` runs the command with accelerate let shard on the CPU and one free byte for the mode's memory check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common import torchrun_two_cpu_processes
from optimum_flatten.cli.main import main
from optimum_flatten.recovery.gate import IMPROVED
from recovery.test_fsdp import needs_fsdp2

pytestmark = [pytest.mark.slow, needs_fsdp2]

SCRIPT = Path(__file__).with_name("fsdp_cli.py")
COMPRESS = ["--method", "replaceme", "--num-layers-to-remove", "2", "--nsamples", "8", "--seqlen", "32",
            "--batch-size", "2", "--no-progress"]  # fmt: skip


def _torchrun(arguments: list[str], cwd: Path) -> None:
    done = torchrun_two_cpu_processes([str(SCRIPT), *arguments], timeout=600, cwd=cwd)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _report(folder: Path) -> dict:
    return json.loads((folder / "flatten_report.json").read_text())


def test_recover_with_fsdp2_saves_the_weights_one_process_trains(llama_on_disk, tmp_path):
    """2 ranks of 1 row a step against 1 process of 2 rows a step: the same global batches, so the same weights up
    to the ranks' round-off (Adam divides by each gradient's running scale: a share of the rate, as in
    tests/recovery/test_fsdp.py)."""
    model, text = llama_on_disk
    compressed = tmp_path / "compressed"
    assert main(["compress", str(model), "--dataset", str(text), *COMPRESS, "--output", str(compressed)]) == 0
    heal = ["recover", str(compressed), "--teacher", str(model), "--dataset", str(text), "--max-steps", "3"]
    heal += ["--seqlen", "32", "--learning-rate", "1e-3", "--heldout-rows", "0", "--no-progress"]
    _torchrun([*heal, "--per-device-train-batch-size", "1", "--output", str(tmp_path / "two")], cwd=tmp_path)
    assert main([*heal, "--mode", "full", "--per-device-train-batch-size", "2", "--output", str(tmp_path / "one")]) == 0
    two, one = _report(tmp_path / "two")["recovery"], _report(tmp_path / "one")["recovery"]
    assert (two["fsdp"], two["processes"], one["fsdp"]) == (2, 2, None)  # `fsdp`: the Trainer sharded the model
    trained, expected = (
        load_file(str(tmp_path / "two" / "model.safetensors")),
        load_file(str(tmp_path / "one" / "model.safetensors")),
    )
    assert trained.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=2e-6, msg=name)
    untrained = load_file(str(compressed / "model.safetensors"))
    assert max((trained[k] - untrained[k]).abs().max().item() for k in untrained) > 1e-4  # it did train
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert type(reloaded).__name__ == "LlamaForCausalLM"


def test_compress_heal_tokens_with_fsdp2_saves_one_whole_healed_model(llama_on_disk, tmp_path):
    model, text = llama_on_disk
    heal = ["--heal-tokens", "192", "--heal-seqlen", "32"]
    _torchrun(["compress", str(model), "--dataset", str(text), *COMPRESS, *heal, "--output", str(tmp_path / "two")],
              cwd=tmp_path)  # fmt: skip
    assert main(["compress", str(model), "--dataset", str(text), *COMPRESS, "--output", str(tmp_path / "plain")]) == 0
    report = _report(tmp_path / "two")
    assert report["recovery"]["fsdp"] == 2 and report["recovery"]["processes"] == 2
    healed, unhealed = (
        load_file(str(tmp_path / "two" / "model.safetensors")),
        load_file(str(tmp_path / "plain" / "model.safetensors")),
    )
    assert healed.keys() == unhealed.keys()
    assert all(tensor.shape == unhealed[name].shape and torch.isfinite(tensor).all() for name, tensor in healed.items())
    # One step at the scaled default rate (6.3e-6 on this tiny model): Adam's first step moves entries by about it.
    assert report["recovery"]["gate"] == IMPROVED and report["recovery"]["steps"] == 1
    moved = max((healed[k] - unhealed[k]).abs().max().item() for k in unhealed)
    assert 0.5 * report["recovery"]["learning_rate"] < moved < 2 * report["recovery"]["learning_rate"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert (
        reloaded.config.num_hidden_layers
        == AutoModelForCausalLM.from_pretrained(tmp_path / "plain").config.num_hidden_layers
    )
