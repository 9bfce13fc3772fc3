"""A FlattenGPT compression killed mid-way resumes from its per-layer state (``FlattenConfig(resume_dir=...)``).

The interruption is a failure injected into the second merged group's compression; the rerun with the same folder
must skip the selection, install the first group from its file, compress only the rest, and end with the weights
of an uninterrupted run bit for bit (the same arithmetic on the same states: the saved block is its float32 weights).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import tiny_models
from common import compress, tiny_config
from optimum_flatten.compression.resume import MANIFEST
from optimum_flatten.methods.flattengpt import FlattenGPTMethod

#: Two merged pairs of the six-layer tiny model.
OPTIONS = {"num_layers_to_remove": 2, "max_group_size": 2}


class _Killed(RuntimeError):
    """The injected failure: stands for the job's time limit."""


class _Counts:
    """Counts the selections and records the groups compressed, optionally failing on the n-th group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_on: int | None = None) -> None:
        self.plans = 0
        self.groups: list[tuple[int, ...]] = []
        plan, compress_group = FlattenGPTMethod.plan, FlattenGPTMethod.compress_group

        def counted_plan(method, *args, **kwargs):
            self.plans += 1
            return plan(method, *args, **kwargs)

        def counted_group(method, adapter, runner, indices, *args, **kwargs):
            if fail_on is not None and len(self.groups) + 1 == fail_on:
                raise _Killed(f"killed while compressing group {list(indices)}")
            self.groups.append(tuple(indices))
            return compress_group(method, adapter, runner, indices, *args, **kwargs)

        monkeypatch.setattr(FlattenGPTMethod, "plan", counted_plan)
        monkeypatch.setattr(FlattenGPTMethod, "compress_group", counted_group)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _assert_same_weights(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    a, b = actual.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run's"


@pytest.mark.parametrize(
    ("mode", "selection"), [("one_pass", "similarity"), ("sequential", "similarity"), ("one_pass", "wide_loss")]
)
def test_a_killed_compression_resumes_and_writes_the_uninterrupted_checkpoint(tmp_path, monkeypatch, mode, selection):
    dense = tiny_models.tiny_llama_gqa()
    options = {**OPTIONS, "calibration_mode": mode, "selection": selection}
    reference = copy.deepcopy(dense)
    expected = compress(reference, "flattengpt", **options)
    merged = [tuple(g) for g in expected.plan.merged_groups]
    assert len(merged) == 2

    resume_dir = tmp_path / "state"
    with monkeypatch.context() as patch:
        counts = _Counts(patch, fail_on=2)
        with pytest.raises(_Killed):
            compress(copy.deepcopy(dense), "flattengpt", resume_dir=str(resume_dir), **options)
    assert counts.plans == 1 and counts.groups == [merged[0]]
    files = sorted(p.name for p in resume_dir.iterdir())
    assert files == sorted([MANIFEST, f"group-{merged[0][0]:03d}-{merged[0][-1]:03d}.safetensors"])
    assert json.loads((resume_dir / MANIFEST).read_text())["plan"] == expected.plan.to_dict()

    # A kill during a write leaves at most a temporary file, which the resumed run neither reads nor deletes.
    (resume_dir / ".tmp-1-group-999-999.safetensors").write_bytes(b"half a file")
    with monkeypatch.context() as patch:
        counts = _Counts(patch)
        resumed_model = copy.deepcopy(dense)
        resumed = compress(resumed_model, "flattengpt", resume_dir=str(resume_dir), **options)
    assert counts.plans == 0, "the selection ran again"
    assert counts.groups == [merged[1]], "only the unfinished group is compressed"
    assert resumed.plan.to_dict() == expected.plan.to_dict()
    _assert_same_weights(resumed_model, reference)
    assert resumed.report.method_entries["groups"] == expected.report.method_entries["groups"]
    for entry in ("similarity", "selection_steps"):  # the selection's report entries, kept with the plan
        assert resumed.report.method_entries.get(entry) == expected.report.method_entries.get(entry)
    # The report counts the work the first attempt kept (its selection and first group), not this attempt's alone.
    kept = resumed.report.method_entries["resumed"]
    assert kept["stack_passes_before"] > 0 and kept["seconds_before"] > 0
    assert resumed.report.cost["stack_passes"] > kept["stack_passes_before"]
    assert resumed.report.total_seconds > kept["seconds_before"]
    assert "resumed" not in expected.report.method_entries

    # The finished job's state stays; a rerun reproduces the checkpoint from it without compressing anything.
    with monkeypatch.context() as patch:
        counts = _Counts(patch)
        again = copy.deepcopy(dense)
        compress(again, "flattengpt", resume_dir=str(resume_dir), **options)
    assert counts.plans == 0 and counts.groups == []
    _assert_same_weights(again, reference)


def test_a_first_run_with_resume_dir_equals_one_without(tmp_path):
    """Saving the state changes nothing of the result (nor does stopping the propagation after the last group)."""
    dense = tiny_models.tiny_llama_gqa()
    reference, with_state = copy.deepcopy(dense), copy.deepcopy(dense)
    compress(reference, "flattengpt", **OPTIONS)
    compress(with_state, "flattengpt", resume_dir=str(tmp_path / "s"), **OPTIONS)
    _assert_same_weights(with_state, reference)
    assert len(list((tmp_path / "s").glob("group-*.safetensors"))) == 2


@pytest.mark.parametrize(
    ("model_seed", "options", "differs"),
    [
        (1, {}, "weights"),  # another model
        # The hashed entries name what differs behind them.
        (0, {"ridge_ratio": 3.0}, r"options differs from this run's: method_args.ridge_ratio: \S+ then, 3.0 now"),
        (0, {"nsamples": 6}, r"calibration differs from this run's: nsamples: \d+ then, 6 now"),
        (0, {"num_layers_to_remove": 1}, "num_to_remove"),
    ],
)
def test_another_jobs_state_is_refused_before_any_change(tmp_path, monkeypatch, model_seed, options, differs):
    resume_dir = tmp_path / "state"
    with monkeypatch.context() as patch:
        _Counts(patch, fail_on=2)
        with pytest.raises(_Killed):
            compress(tiny_models.tiny_llama_gqa(), "flattengpt", resume_dir=str(resume_dir), **OPTIONS)
    before_files = {p.name: p.read_bytes() for p in resume_dir.iterdir()}
    other = tiny_models.tiny_llama_gqa(seed=model_seed)
    weights = _state(other)
    with pytest.raises(ValueError, match=f"another job.*{differs}"):
        compress(other, "flattengpt", resume_dir=str(resume_dir), **{**OPTIONS, **options})
    _assert_same_weights(other, _Module(weights))
    assert {p.name: p.read_bytes() for p in resume_dir.iterdir()} == before_files, "the folder was changed"


class _Module(torch.nn.Module):
    """A state_dict holder, for comparing a model with weights saved before."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return self._state


def test_a_folder_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model = tiny_models.tiny_llama_gqa()
    weights = _state(model)
    with pytest.raises(ValueError, match=r"no manifest\.json"):
        compress(model, "flattengpt", resume_dir=str(tmp_path), **OPTIONS)
    _assert_same_weights(model, _Module(weights))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("damage", ["truncated", "no metadata"])
def test_a_damaged_group_file_is_refused_before_any_change(tmp_path, damage):
    """Found when the folder is opened, not when its group's turn comes with the groups before it in the model."""
    from safetensors.torch import save_file

    compress(tiny_models.tiny_llama_gqa(), "flattengpt", resume_dir=str(tmp_path), **OPTIONS)
    groups = sorted(tmp_path.glob("group-*.safetensors"))
    assert len(groups) >= 2
    if damage == "truncated":
        data = groups[-1].read_bytes()
        groups[-1].write_bytes(data[: len(data) // 2])
    else:
        save_file({"weight": torch.zeros(2)}, str(groups[-1]))
    model = tiny_models.tiny_llama_gqa()
    weights = _state(model)
    with pytest.raises(ValueError, match=f"the finished group {groups[-1].name} cannot be read back") as refused:
        compress(model, "flattengpt", resume_dir=str(tmp_path), **OPTIONS)
    assert "\n" not in str(refused.value)
    _assert_same_weights(model, _Module(weights))


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("shortgpt", {"num_layers_to_remove": 2}, "keeps no per-layer state"),
        ("flattengpt", {**OPTIONS, "selection": "loss"}, "selection='loss'"),
        ("flattengpt", {**OPTIONS, "linear_replacement": "lstsq"}, "linear_replacement"),
    ],
)
def test_configurations_that_cannot_resume_are_refused(tmp_path, method, options, message):
    model = tiny_models.tiny_llama_gqa()
    weights = _state(model)
    with pytest.raises(ValueError, match=message):
        compress(model, method, resume_dir=str(tmp_path / "s"), **options)
    _assert_same_weights(model, _Module(weights))
    assert not (tmp_path / "s").exists()


def test_the_command_line_flag_reaches_the_config(tmp_path):
    import argparse

    from optimum_flatten.cli.main import build_parser
    from optimum_flatten.cli.options import config_kwargs

    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["compress"]
    args = parser.parse_args(["m", "--output", "o", "--num-layers-to-remove", "2", "--resume-dir", str(tmp_path)])
    kwargs = config_kwargs(args)
    assert kwargs["resume_dir"] == str(tmp_path)
    config = tiny_config(kwargs.pop("method"), **kwargs)
    assert config.resume_dir == str(tmp_path)
    assert "resume_dir" not in config.to_dict(), "a local path is never serialised"
