"""Healing under 2 processes (torch.distributed, DDP on gloo, CPU) gives the weights of one process.

The same tiny model, compressed the same way, is healed by `ddp_heal.py` once under ``torch.distributed.run
--nproc_per_node 2`` and once here in one process, with the same global batch per step (4 rows) and the same seeded
row order: `full` with accelerate's default per-process batches (2 processes x 2 rows against 1 x 4: the sampler's
one order, dealt out batch by batch), `changed` with ``split_batches`` (each step's 4 rows cut in two). The step's
loss is a mean over the scored tokens of every process's rows (each process's mean weighted by its share of the
step's count, gathered across processes), so what is left is float round-off (the gradient sums in another order).
The gate (held-out scoring every step) must take the same decisions, and the token budget must give the same steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import launch_two_gloo_processes

from . import ddp_heal

SCRIPT = Path(__file__).with_name("ddp_heal.py")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """The folder where rank 0 of a 2-process launch left `<mode>.pt` for every mode of `ddp_heal.MODES`."""
    out = tmp_path_factory.mktemp("ddp")
    launch_two_gloo_processes(SCRIPT, out, timeout=300)
    return out


@pytest.mark.parametrize("mode", list(ddp_heal.MODES))
def test_two_processes_heal_to_the_weights_of_one(two_processes, mode):
    distributed = torch.load(two_processes / f"{mode}.pt")
    before, after, log = ddp_heal.heal(mode, processes=1)
    # The same starting point on every process and here: the comparison is of the healing alone.
    assert all(torch.equal(before[k], distributed["before"][k]) for k in before)
    theirs = distributed["log"]
    assert theirs["processes"] == 2 and log["processes"] == 1
    # The budget is global: the same steps and tokens, whatever the launch.
    assert theirs["steps"] == log["steps"] == ddp_heal.STEPS
    assert theirs["tokens_trained"] == log["tokens_trained"] == ddp_heal.STEPS * ddp_heal.GLOBAL_BATCH * ddp_heal.SEQLEN
    # The gate saw the same held-out scores and kept the same step.
    assert theirs["gate"] == log["gate"] and theirs["best_step"] == log["best_step"]
    ours = torch.tensor([h["objective"] for h in log["heldout_history"]])
    torch.testing.assert_close(torch.tensor([h["objective"] for h in theirs["heldout_history"]]), ours)
    assert bool((ours[1:] < ours[0]).all())  # healing helped, so the gate kept a trained state
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed, "healing changed nothing: the comparison would prove nothing"
    assert max(float((after[k] - before[k]).abs().max()) for k in changed) > 1e-3
    # The same tensors trained (for `changed`: everything else bit-identical on both sides).
    assert {k for k in after if not torch.equal(distributed["after"][k], before[k])} == set(changed)
    for name, tensor in after.items():
        torch.testing.assert_close(
            distributed["after"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_two_processes_guarded_refuse_the_steps_one_refuses_and_keep_its_weights(two_processes):
    """The guard's rows are scored on every rank and agreed as the held-out objective is: the same guard scores, the
    same refused evaluations, the same kept step and weights as one process."""
    guarded = torch.load(two_processes / "guarded.pt")
    _, after, log = ddp_heal.heal("full", processes=1, guard_text=ddp_heal.GUARD)
    theirs = guarded["log"]
    assert theirs["processes"] == 2 and log["processes"] == 1
    # The guard changed the choice: the held-out objective fell at every step, yet step 2 is kept.
    assert log["guard"]["refused_steps"] == theirs["guard"]["refused_steps"] == [3, 4]
    assert log["best_step"] == theirs["best_step"] == 2 and theirs["gate"] == log["gate"]
    objective = torch.tensor([h["objective"] for h in log["heldout_history"]])
    assert bool((objective.diff() < 0).all())
    ours = torch.tensor([h["guard_objective"] for h in log["heldout_history"]])
    torch.testing.assert_close(torch.tensor([h["guard_objective"] for h in theirs["heldout_history"]]), ours)
    assert bool((ours[3:] > ours[0]).all()) and bool((ours[1:3] <= ours[0]).all())
    for name, tensor in after.items():
        torch.testing.assert_close(guarded["after"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_two_processes_stopped_and_resumed_heal_to_the_weights_of_one_uninterrupted(two_processes):
    """A 2-process healing checkpointed every 2 steps, stopped at step 3 and resumed from step 2's checkpoint (rank 0
    wrote it; both read it, each its own random state) ends where one process trained without a stop does."""
    resumed = torch.load(two_processes / "resumed.pt")
    _, after, log = ddp_heal.heal("full", processes=1)
    theirs = resumed["log"]
    assert theirs["processes"] == 2 and theirs["resumed_from_step"] == [2]
    assert theirs["steps"] == log["steps"] and theirs["best_step"] == log["best_step"]
    torch.testing.assert_close(
        torch.tensor([h["objective"] for h in theirs["heldout_history"]]),
        torch.tensor([h["objective"] for h in log["heldout_history"]]),
    )
    for name, tensor in after.items():
        torch.testing.assert_close(resumed["after"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
