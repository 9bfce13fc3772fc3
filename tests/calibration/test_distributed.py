"""Calibration across 2 processes (torch.distributed on gloo, CPU) gives the plan and the weights of one process.

`ddp_calibrate.py` compresses the same tiny model under ``torch.distributed.run --nproc_per_node 2``: each rank
calibrates on its share of the 5 padded batches (2 and 3) and every statistic is summed over the ranks where it is
complete. Here the same compressions run in one process on all 5 batches. The plans must be equal, the decisions
inside them too (FlattenGPT's kept heads and channels, the bridges' ridge), the token counts equal, and the weights
equal up to the order of the float sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import TOLERANCES, launch_two_gloo_processes, logits, sample_ids
from optimum_flatten.calibration.distributed import (
    all_reduce_,
    all_reduce_sums,
    global_batches,
    is_sharded,
    shard_range,
    sharded_calibration,
)

from . import ddp_calibrate

SCRIPT = Path(__file__).with_name("ddp_calibrate.py")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """The folder where a 2-process launch of `ddp_calibrate.py` left its results."""
    out = tmp_path_factory.mktemp("ddp_calibration")
    launch_two_gloo_processes(SCRIPT, out, timeout=600)
    return out


@pytest.mark.parametrize("case", list(ddp_calibrate.CASES))
def test_two_processes_calibrate_to_the_plan_and_weights_of_one(two_processes, case):
    theirs = torch.load(two_processes / f"{case}.pt")
    model, _, ours = ddp_calibrate.run(case)
    # The plan's decisions exactly; the scores it carries (ShortGPT's) to round-off.
    their_scores, our_scores = theirs["plan"].pop("scores", None), ours["plan"].pop("scores", None)
    assert theirs["plan"] == ours["plan"]
    if our_scores is not None:
        torch.testing.assert_close(torch.tensor(their_scores), torch.tensor(our_scores), atol=1e-12, rtol=0)
    # The calibration was padded (unpacked text) and counted whole on both sides.
    report, their_report = ours["report"], theirs["report"]
    assert report["calibration"]["tokens"] < ddp_calibrate.CALIBRATION["nsamples"] * ddp_calibrate.CALIBRATION["seqlen"]
    assert their_report["calibration"]["tokens"] == report["calibration"]["tokens"]
    assert their_report["calibration"]["processes"] == 2 and "processes" not in report["calibration"]
    atol, rtol = TOLERANCES[torch.float32]
    assert set(theirs["state"]) == set(ours["state"])
    for name, tensor in ours["state"].items():
        torch.testing.assert_close(theirs["state"][name], tensor, atol=atol, rtol=rtol, msg=name)
    method = ddp_calibrate.CASES[case][0]
    if method == "shortgpt":
        torch.testing.assert_close(
            torch.tensor(their_report["block_influence"]), torch.tensor(report["block_influence"]), atol=1e-6, rtol=0
        )
    if method == "replaceme":
        torch.testing.assert_close(
            torch.tensor(list(their_report["block_distances"].values())),
            torch.tensor(list(report["block_distances"].values())),
            atol=1e-6,
            rtol=0,
        )
    assert their_report.get("one_pass") == report.get("one_pass")
    if case == "replaceme_one_pass":
        assert (
            report["one_pass"]["chosen_on_shortlist"] and report["replaceme"]["states"] == "one pass with the selection"
        )
    bridges = report.get("replaceme") or report.get("linear_replacement")
    if bridges is not None:
        their_bridges = their_report.get("replaceme") or their_report.get("linear_replacement")
        assert their_bridges["states"] == bridges["states"]
        for mine, other in zip(bridges["maps"], their_bridges["maps"], strict=True):
            assert (other["span"], other["tokens"], other.get("ridge")) == (
                mine["span"],
                mine["tokens"],
                mine.get("ridge"),
            )
            assert other.get("ridge_chosen_on") == mine.get("ridge_chosen_on")
    if method == "flattengpt":
        for mine, other in zip(report["groups"], their_report["groups"], strict=True):
            for key in ("kept_kv_groups", "kept_channels_per_member", "calibration_tokens"):
                assert other[key] == mine[key], key
        torch.testing.assert_close(
            torch.tensor(their_report["similarity"], dtype=torch.float64),
            torch.tensor(report["similarity"], dtype=torch.float64),
            atol=1e-6,
            rtol=0,
            equal_nan=True,
        )
        # Rank 0 alone wrote the checkpoint every rank saved; it is the one-process model.
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(two_processes / "checkpoint").eval()
        ids = sample_ids()
        torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), atol=atol, rtol=rtol)


def test_rank_0_alone_saves_and_uploads_when_every_rank_pushes(two_processes):
    assert (two_processes / "uploaded_by_rank_0.txt").read_text() == str((two_processes / "pushed_0").resolve())
    assert (two_processes / "pushed_0" / "config.json").is_file()
    assert not (two_processes / "uploaded_by_rank_1.txt").exists() and not (two_processes / "pushed_1").exists()


def test_a_method_that_does_not_shard_is_refused_on_every_rank(two_processes):
    for rank in (0, 1):
        message = (two_processes / f"refusal_{rank}.txt").read_text()
        assert f"rank {rank} of 2" in message and "'sleb' cannot calibrate across processes" in message
        assert "flattengpt" in message and "replaceme" in message and "shortgpt" in message
        assert "in one process" in message


def test_shares_are_contiguous_even_and_cover_every_batch():
    for num, world in [(5, 2), (8, 3), (3, 3), (16, 4)]:
        shares = [shard_range(num, rank, world) for rank in range(world)]
        assert [i for share in shares for i in share] == list(range(num))
        assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_outside_a_sharded_calibration_nothing_is_reduced():
    """One process (or code outside the compression) never waits on a collective."""
    tensor = torch.arange(4.0)
    assert not is_sharded()
    with sharded_calibration(1):
        assert not is_sharded()
        assert all_reduce_(tensor) is tensor and torch.equal(tensor, torch.arange(4.0))
        assert all_reduce_sums(1.5, 3) == (1.5, 3)
        assert global_batches(4) == (range(4), 4)
