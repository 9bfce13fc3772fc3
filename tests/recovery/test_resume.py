"""A healing stopped and started again on its checkpoint folder (`recovery.resume`) ends on the weights and log of one
uninterrupted run; the options that cannot work are refused before any weight changes."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch

import tiny_models
from common import tiny_recovery_config
from optimum_flatten.recovery import recover
from optimum_flatten.recovery import resume as resume_module


class Stopped(RuntimeError):
    """Stands for the process being killed (a preempted job, a session's end)."""


def _stop_at(monkeypatch, phase: int, step: int) -> None:
    """Stops the healing as phase `phase` ends optimiser step `step`, after the gate has scored it and before the
    Trainer would save it: the newest checkpoint is then an earlier one."""

    def on_step_end(self, args, state, control, **kwargs):
        if args.output_dir.endswith(f"phase-{phase}") and state.global_step == step:
            raise Stopped(f"stopped in phase {phase} at step {step}")
        return control

    monkeypatch.setattr(resume_module.CheckpointState, "on_step_end", on_step_end, raising=False)


def _heal(model, config, dense, report):
    # LoRA's adapters start from the global random state (the Trainer seeds only once it is built): the same state
    # for every run here, so that two uninterrupted runs agree (a resumed run loads its adapters from the checkpoint).
    torch.manual_seed(0)
    return recover(
        copy.deepcopy(model), tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=dense,
        report=report,
    )  # fmt: skip


#: (options, phase and step to stop at): full-parameter training behind the gate; LoRA (its dropout draws random
#: numbers, which the Trainer's checkpoint must restore); local then global, stopped in either phase.
CASES = {
    "full": ({"mode": "full", "max_tokens": 384, "learning_rate": 1e-3}, 1, 5),
    "lora": ({"mode": "lora", "max_tokens": 384, "learning_rate": 1e-2}, 1, 5),
    "local_then_global_in_phase_1": (
        {"mode": "local", "max_tokens": 384, "local_then_global_tokens": 256, "learning_rate": 1e-3}, 1, 5,
    ),
    "local_then_global_in_phase_2": (
        {"mode": "local", "max_tokens": 256, "local_then_global_tokens": 384, "learning_rate": 1e-3}, 2, 5,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_healing_stopped_and_resumed_ends_on_the_weights_of_an_uninterrupted_run(
    case, compressed, tmp_path, monkeypatch
):
    dense, model, report = compressed
    options, phase, step = CASES[case]
    base = {**options, "heldout_rows": 2, "eval_every": 2, "patience": 0, "logging_steps": 1}
    whole, whole_log = _heal(model, tiny_recovery_config(**base), dense, report)

    folder = tmp_path / "checkpoints"
    config = tiny_recovery_config(**base, checkpoint_dir=str(folder), save_every=2)
    with monkeypatch.context() as patch:
        _stop_at(patch, phase, step)
        with pytest.raises(Stopped):
            _heal(model, config, dense, report)
    newest = resume_module.latest_checkpoint(str(folder / f"phase-{phase}"))
    assert newest is not None and newest.endswith("checkpoint-4")
    assert (folder / "phase-1" / resume_module.PHASE_DONE).exists() == (phase == 2)

    resumed, log = _heal(model, tiny_recovery_config(**base, checkpoint_dir=str(folder), save_every=2),
                         dense, report)  # fmt: skip
    expected = whole.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    for key in ("steps", "tokens_trained", "heldout_before", "heldout_after", "best_step", "heldout_history", "gate"):
        assert log[key] == whole_log[key], key
    if "global_phase" in whole_log:
        assert log["global_phase"]["heldout_history"] == whole_log["global_phase"]["heldout_history"]
    phases = 2 if "global_phase" in whole_log else 1
    assert log["resumed_from_step"] == [4 if index == phase else None for index in range(1, phases + 1)]
    assert log["train_seconds"] > 0


def test_a_finished_healing_resumed_replays_its_record_without_training(compressed, tmp_path, monkeypatch):
    dense, model, report = compressed
    base = {"mode": "full", "max_tokens": 256, "learning_rate": 1e-3, "heldout_rows": 2, "eval_every": 2}
    folder = str(tmp_path / "checkpoints")
    healed, log = _heal(model, tiny_recovery_config(**base, checkpoint_dir=folder), dense, report)

    def no_training(*args, **kwargs):
        raise AssertionError("a finished phase trains again")

    monkeypatch.setattr("transformers.Trainer.train", no_training)
    again, replayed = _heal(model, tiny_recovery_config(**base, checkpoint_dir=folder), dense, report)
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, healed.state_dict()[name]), name
    assert replayed["heldout_history"] == log["heldout_history"] and replayed["steps"] == log["steps"]
    on_disk = sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())
    assert log["checkpoint_bytes"] == replayed["checkpoint_bytes"] == on_disk > 0  # what is left to remove


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"save_every": 2}, "save_every needs checkpoint_dir"),
        ({"save_every": -1, "checkpoint_dir": "x"}, "save_every must be 0"),
    ],
)
def test_checkpoint_options_that_cannot_work_are_refused_before_any_change(options, message, compressed, tmp_path):
    dense, model, report = compressed
    before = copy.deepcopy(model)
    target = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message):
        recover(target, tiny_models.CharTokenizer(), tiny_models.sample_texts(),
                tiny_recovery_config(mode="full", **options), teacher=dense, report=report)  # fmt: skip
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before.state_dict()[name]), name


def test_a_folder_holding_a_healing_with_other_options_is_refused_before_any_change(compressed, tmp_path, monkeypatch):
    dense, model, report = compressed
    folder = str(tmp_path / "checkpoints")
    base = {"mode": "full", "max_tokens": 384, "learning_rate": 1e-3, "checkpoint_dir": folder, "save_every": 2}
    with monkeypatch.context() as patch:
        _stop_at(patch, 1, 3)
        with pytest.raises(Stopped):
            _heal(model, tiny_recovery_config(**base), dense, report)
    saved = tmp_path / "checkpoints" / "phase-1" / "checkpoint-2" / resume_module.HEALING_STATE
    state = json.loads(saved.read_text())
    assert state["step"] == 2 and state["gate"] is None and state["options"]["learning_rate"] == 1e-3
    target = copy.deepcopy(model)
    changed = tiny_recovery_config(**{**base, "learning_rate": 2e-3})
    with pytest.raises(ValueError, match=r"other options \(learning_rate: 0.001 then, 0.002 now\)"):
        recover(target, tiny_models.CharTokenizer(), tiny_models.sample_texts(), changed, teacher=dense,
                report=report)  # fmt: skip
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    # Where and how often to checkpoint may change: the same healing saved every step continues from step 2.
    _, log = _heal(model, tiny_recovery_config(**{**base, "save_every": 1}), dense, report)
    assert log["resumed_from_step"] == [2]


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "stopped"])
def test_a_folder_holding_another_jobs_healing_is_refused_before_any_change(
    compressed, tmp_path, monkeypatch, finished
):
    """The same options on another student or another text: the folder's finished phase (or its checkpoint) is
    another model's, and replaying it would hand back the first healing's weights."""
    dense, model, report = compressed
    folder = str(tmp_path / "checkpoints")
    base = {"mode": "full", "max_tokens": 256, "learning_rate": 1e-3, "heldout_rows": 2, "checkpoint_dir": folder}
    with monkeypatch.context() as patch:
        if not finished:
            base["save_every"] = 1
            _stop_at(patch, 1, 3)
        with contextlib.nullcontext() if finished else pytest.raises(Stopped):
            _heal(model, tiny_recovery_config(**base), dense, report)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    kept = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    texts = tiny_models.sample_texts()
    cases = (
        (other, texts, "the model being healed"),
        (model, texts[::-1], "the training rows"),
        # The weights' fingerprint is blind to the dtype: recover --dtype bfloat16 used to go on from float32 state.
        (copy.deepcopy(model).bfloat16(), texts, "the dtype of the weights trained .*: float32 then, bfloat16 now"),
    )
    for student, text, named in cases:
        target = copy.deepcopy(student)
        before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
        with pytest.raises(ValueError, match=f"holds the healing of another job \\({named}"):
            recover(target, tiny_models.CharTokenizer(), text, tiny_recovery_config(**base),
                    teacher=copy.deepcopy(dense), report=report)  # fmt: skip
        for name, tensor in target.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    assert all(torch.equal(tensor, kept[name]) for name, tensor in other.state_dict().items())
    _, log = _heal(model, tiny_recovery_config(**base), dense, report)  # the job it holds still resumes
    assert log["resumed_from_step"] == [None if finished else 2]


def test_a_checkpoint_without_the_healing_state_is_not_resumed_from(tmp_path):
    """The healing state is written last: a checkpoint folder without it (a process killed while saving) is passed
    over for the newest complete one."""
    phase = tmp_path / "phase-1"
    for step, complete in ((2, True), (4, True), (6, False)):
        (phase / f"checkpoint-{step}").mkdir(parents=True)
        if complete:
            (phase / f"checkpoint-{step}" / resume_module.HEALING_STATE).write_text("{}")
    assert resume_module.latest_checkpoint(str(phase)) == str(phase / "checkpoint-4")
    assert resume_module.latest_checkpoint(str(tmp_path / "missing")) is None


@pytest.mark.gpu
def test_a_healing_resumed_on_cuda_in_bfloat16_keeps_placement_dtype_and_the_gate(compressed, tmp_path, monkeypatch):
    """On a CUDA device in bfloat16, the resumed run's model stays on the device and in bfloat16, its gate continues
    the stopped run's history, and it ends near the uninterrupted run (not to the bit: the embedding's backward adds
    into shared rows with atomics, in any order)."""
    dense, model, report = (copy.deepcopy(part) for part in compressed)
    dense, model = dense.to("cuda", torch.bfloat16), model.to("cuda", torch.bfloat16)
    base = {"mode": "full", "max_tokens": 384, "learning_rate": 1e-3, "heldout_rows": 2, "eval_every": 2, "patience": 0}
    whole, whole_log = _heal(model, tiny_recovery_config(**base), dense, report)
    folder = str(tmp_path / "checkpoints")
    config = tiny_recovery_config(**base, checkpoint_dir=folder, save_every=2)
    with monkeypatch.context() as patch:
        _stop_at(patch, 1, 5)
        with pytest.raises(Stopped):
            _heal(model, config, dense, report)
    resumed, log = _heal(model, tiny_recovery_config(**base, checkpoint_dir=folder, save_every=2),
                         dense, report)  # fmt: skip
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in resumed.parameters())
    assert log["resumed_from_step"] == [4] and log["steps"] == whole_log["steps"]
    assert [entry["step"] for entry in log["heldout_history"]] == [0, 2, 4, 6]
    for name, tensor in resumed.state_dict().items():
        torch.testing.assert_close(tensor, whole.state_dict()[name], atol=2e-2, rtol=2e-2, msg=name)


def test_a_default_mode_healing_resumed_with_less_free_memory_keeps_the_mode_it_started_with(
    compressed, tmp_path, monkeypatch
):
    """The default follows the memory free when asked: full fit (split into local then global after the merges)
    when the healing started, and the resume finds less free (another job on the machine). The same line must
    continue the same healing, not be refused for a mode the user never named."""
    from optimum_flatten.recovery import footprint
    from optimum_flatten.recovery.mode import AS_STARTED

    dense, model, report = compressed
    folder = str(tmp_path / "checkpoints")
    base = {"mode": None, "max_tokens": 384, "learning_rate": 1e-3, "checkpoint_dir": folder, "save_every": 1}
    whole, whole_log = _heal(model, tiny_recovery_config(**{**base, "checkpoint_dir": None, "save_every": 0}), dense,
                             report)  # fmt: skip
    assert whole_log["mode"] == "local" and "global_phase" in whole_log  # full fitted: split after the merges
    with monkeypatch.context() as patch:
        _stop_at(patch, 1, 3)
        with pytest.raises(Stopped):
            _heal(model, tiny_recovery_config(**base), dense, report)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 1)  # now nothing fits
    fresh = tiny_recovery_config(**{**base, "checkpoint_dir": str(tmp_path / "fresh")})
    _, squeezed = _heal(model, fresh, dense, report)
    assert "global_phase" not in squeezed  # a fresh run would choose otherwise now ...
    resumed, log = _heal(model, tiny_recovery_config(**base), dense, report)  # ... the resumed one continues
    assert log["resumed_from_step"] == [2, None] and AS_STARTED in log["mode_chosen"]
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, whole.state_dict()[name]), name


def test_a_resume_on_another_number_of_processes_is_refused():
    """The global batch, and so the steps of the budget, follow the processes: a healing started on 2 ranks went on
    silently on 1 (another step count, a report saying 1 process) or trained 0 steps on more."""
    from optimum_flatten.recovery.resume import _check_same_options, healing_identity, options_fingerprint

    config = tiny_recovery_config()
    saved = options_fingerprint(config, healing_identity("s", "t", [], [], processes=2, dtype="float32"))
    now = healing_identity("s", "t", [], [], processes=1, dtype="float32")
    message = r"the number of processes \(so the global batch and the steps\): 2 then, 1 now"
    with pytest.raises(ValueError, match=message):
        _check_same_options(saved, config, "checkpoint-4", now)
    old = {**saved, "job": {k: v for k, v in saved["job"].items() if k not in ("processes", "dtype")}}
    _check_same_options(old, config, "checkpoint-4", now)  # recorded before the processes were: not compared


def test_a_phase_its_gate_had_stopped_trains_no_further_step_when_resumed(compressed, tmp_path):
    """The gate ran out of patience at a checkpoint and the run was killed before the phase was recorded as done:
    the resume trained on past the stop, to a state the uninterrupted run never reached."""
    from optimum_flatten.recovery.resume import PHASE_DONE, PHASE_STATE

    dense, model, report = compressed
    folder = tmp_path / "checkpoints"
    options = {"mode": "full", "max_tokens": 1024, "learning_rate": 3e-2, "heldout_rows": 2, "eval_every": 2,
               "patience": 2, "save_every": 2, "checkpoint_dir": str(folder)}  # fmt: skip
    whole, log = _heal(model, tiny_recovery_config(**options), dense, report)
    assert log["steps"] < 1024 // 64, "the gate must stop this run early for the test to mean anything"
    for name in (PHASE_DONE, PHASE_STATE):  # killed between the stop and the phase's record
        (folder / "phase-1" / name).unlink()
    resumed, again = _heal(model, tiny_recovery_config(**options), dense, report)
    assert again["steps"] == log["steps"] and again["gate"] == log["gate"]
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
