"""The command line under the launchers users run: ``torchrun --nproc-per-node 2 -m optimum_flatten compress`` and
``... recover`` on 2 CPU processes (gloo) write the weights one process writes, rank 0 alone writes, and both ranks
exit 0; a method that cannot calibrate across ranks is refused in one line, before anything is written (every
rank refuses; torchrun may stop the slower one before it prints)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from common import torchrun_two_cpu_processes
from optimum_flatten.cli.main import main

pytestmark = pytest.mark.slow

COMPRESS = ["--num-layers-to-remove", "2", "--nsamples", "8", "--seqlen", "32", "--batch-size", "2", "--no-progress"]


@pytest.fixture
def dense(llama_on_disk):
    return llama_on_disk


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _torchrun(arguments: list[str], cwd) -> str:
    done = torchrun_two_cpu_processes(["-m", "optimum_flatten", *arguments], timeout=600, cwd=cwd)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("method", ["replaceme", "flattengpt"])
def test_compress_under_torchrun_calibrates_across_ranks_and_writes_what_one_process_writes(dense, tmp_path, method):
    model, text = dense
    arguments = ["compress", str(model), "--method", method, "--dataset", str(text), *COMPRESS]
    printed = _torchrun([*arguments, "--output", str(tmp_path / "two")], cwd=tmp_path)
    assert printed.count("saved to") == 1  # rank 0 alone writes and prints
    assert "calibrated by" in printed and "2 processes" in printed
    report = json.loads((tmp_path / "two" / "flatten_report.json").read_text())
    assert report["calibration"]["processes"] == 2
    # The cost is one rank's (its share of the tokens, its solves), and says so; the tokens are every rank's.
    assert report["cost"]["per_rank"] and "this rank's share of the calibration (2 processes" in report["cost"]["unit"]
    assert f"one pass of {report['calibration']['tokens'] // 2} calibration tokens" in report["cost"]["unit"]
    assert main([*arguments, "--output", str(tmp_path / "one")]) == 0
    _assert_same_weights(_weights(tmp_path / "two"), _weights(tmp_path / "one"))
    assert "processes" not in json.loads((tmp_path / "one" / "flatten_report.json").read_text())["calibration"]


def test_compress_with_a_default_heal_under_torchrun_trains_full_after_a_merge(dense, tmp_path):
    """After a plan that merged layers the default heal is `local` then global on one process; `local` cannot run
    across ranks, so under torchrun the default stays `full` (it was chosen after the compression, and refused)."""
    model, text = dense
    arguments = ["compress", str(model), "--method", "flattengpt", "--dataset", str(text), *COMPRESS]
    printed = _torchrun([*arguments, "--heal-tokens", "1024", "--output", str(tmp_path / "two")], cwd=tmp_path)
    assert printed.count("saved to") == 1
    report = json.loads((tmp_path / "two" / "flatten_report.json").read_text())
    assert report["recovery"]["mode"] == "full" and report["recovery"]["processes"] == 2
    assert report["recovery"]["mode_chosen"].startswith("the default") and "global_phase" not in report["recovery"]


def test_a_method_that_cannot_shard_is_refused_on_every_rank_before_anything_is_written(dense, tmp_path):
    model, text = dense
    out = tmp_path / "refused"
    arguments = ["compress", str(model), "--method", "laco", "--dataset", str(text), *COMPRESS, "--output", str(out)]
    done = torchrun_two_cpu_processes(["-m", "optimum_flatten", *arguments], timeout=600, cwd=tmp_path)
    assert done.returncode != 0
    # Each rank refuses on its own, but torchrun stops the other worker as soon as one exits non-zero, so the
    # slower rank's line may never be printed: one or two refusal lines, and no other error or traceback.
    refusals = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(refusals) <= 2, done.stderr[-3000:]
    assert all("cannot calibrate across processes" in line for line in refusals), refusals
    frames = [
        line for line in done.stderr.splitlines() if line.strip().startswith("File ") and "optimum_flatten" in line
    ]
    assert not frames, frames  # torchrun's own traceback follows; no rank's
    assert not out.exists()


def test_recover_under_torchrun_trains_one_model_with_the_mode_one_process_picks(dense, tmp_path):
    """2 ranks of 1 row a step against 1 process of 2 rows a step: the same global batches (accelerate deals the
    seeded permutation's batches to the ranks in turn), so the same weights up to float round-off."""
    model, text = dense
    compressed = tmp_path / "compressed"
    assert main(["compress", str(model), "--method", "replaceme", "--dataset", str(text), *COMPRESS,
                 "--output", str(compressed)]) == 0  # fmt: skip
    heal = ["recover", str(compressed), "--teacher", str(model), "--dataset", str(text), "--max-steps", "3"]
    heal += ["--seqlen", "32", "--learning-rate", "1e-3", "--heldout-rows", "0"]  # no gate: the trained state is kept
    _torchrun([*heal, "--per-device-train-batch-size", "1", "--output", str(tmp_path / "two")], cwd=tmp_path)
    assert main([*heal, "--per-device-train-batch-size", "2", "--output", str(tmp_path / "one")]) == 0
    two = json.loads((tmp_path / "two" / "flatten_report.json").read_text())["recovery"]
    one = json.loads((tmp_path / "one" / "flatten_report.json").read_text())["recovery"]
    assert (two["processes"], one["processes"]) == (2, 1)
    assert two["mode"] == one["mode"] == "full"  # not LoRA: every rank's memory was checked, the smallest won
    assert two["tokens_trained"] == one["tokens_trained"] == 3 * 2 * 32
    trained, expected = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    _assert_same_weights(trained, expected)
    untrained = _weights(compressed)
    assert max((trained[k] - untrained[k]).abs().max().item() for k in untrained) > 1e-4  # it did train


#: Run by `torch.distributed.run`: the command line with the group's timeout cut to 3 s and rank 0's save made 8 s
#: slower, as a large model's save or upload outlasts the real timeout (10 minutes under NCCL, 30 under gloo).
SLOW_SAVE = """
import datetime, sys, time
import torch.distributed as dist
join = dist.init_process_group
dist.init_process_group = lambda *a, **k: join(*a, **{**k, "timeout": datetime.timedelta(seconds=3)})
from optimum_flatten.quantizer import FlattenQuantizer
save = FlattenQuantizer.save
def slow_save(self, *a, **k):
    time.sleep(8)
    return save(self, *a, **k)
FlattenQuantizer.save = slow_save
from optimum_flatten.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_save_longer_than_the_groups_timeout_finishes_under_torchrun(dense, tmp_path):
    """The ranks that do not write leave the group at once instead of waiting for rank 0 at a barrier, which timed
    out, failed them, and had torchrun stop rank 0 mid-save."""
    model, text = dense
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    out = tmp_path / "saved"
    arguments = ["compress", str(model), "--method", "shortgpt", "--dataset", str(text), *COMPRESS]
    done = torchrun_two_cpu_processes([str(script), *arguments, "--output", str(out)], timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.count("saved to") == 1 and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_compress_with_the_models_own_text_under_torchrun_writes_what_one_process_writes(dense, tmp_path):
    """`--own-text`: every rank samples all of the model's rows with the same seed, so the calibration both ranks
    share, and the weights, are one process's; rank 0 alone keeps the record."""
    model, text = dense
    arguments = ["compress", str(model), "--method", "replaceme", "--dataset", str(text), "--own-text", "0.5"]
    printed = _torchrun([*arguments, *COMPRESS, "--output", str(tmp_path / "two")], cwd=tmp_path)
    assert printed.count("saved to") == 1
    report = json.loads((tmp_path / "two" / "flatten_report.json").read_text())
    assert report["calibration"]["processes"] == 2 and report["calibration"]["own_text"]
    assert main([*arguments, *COMPRESS, "--output", str(tmp_path / "one")]) == 0
    _assert_same_weights(_weights(tmp_path / "two"), _weights(tmp_path / "one"))
