"""What a healing's record says, checked against what happened (a review of `optimum-flatten recover`):

- LoRA's adapters start from the seed, not from whatever random state the process had (`recovery.lora`);
- `train_loss` and `loss_history` of a resumed run are those of the same run never stopped, and those of 2 processes
  those of one (`recovery.phases.run_loss`);
- `tokens_trained` counts the real tokens of padded (chat) rows, `positions_trained` the positions;
- the teacher-text cache is found whatever the spelling of the teacher's folder (`recovery.teacher_text_cache`);
- `rows_read_back` counts every rank's rows, and a negative `heldout_rows` is refused (`recovery.teacher_text`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tiny_models
from common import launch_two_gloo_processes, tiny_recovery_config
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery import recover
from optimum_flatten.recovery import resume as resume_module
from optimum_flatten.recovery.data import build_training_rows, load_recovery_texts
from optimum_flatten.recovery.lora import wrap_lora
from optimum_flatten.recovery.teacher_text import heldout_split, sample_teacher_rows
from optimum_flatten.recovery.teacher_text_cache import FinishedBatches

from . import ddp_heal, ddp_review_record
from .test_chat_and_csv import CHATML, CONVERSATIONS

TOKENIZER = tiny_models.CharTokenizer()


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


# --- A: LoRA's adapters start from the seed -----------------------------------------------------------------------


def test_lora_adapters_are_drawn_from_the_seed_whatever_the_random_state_and_leave_it_as_it_was(compressed):
    _, model, _ = compressed
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = _adapters(wrap_lora(copy.deepcopy(model), RecoveryConfig(mode="lora", seed=0))[0])
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is untouched
    torch.manual_seed(2)  # another process's state: torch seeds each new process at random
    again = _adapters(wrap_lora(copy.deepcopy(model), RecoveryConfig(mode="lora", seed=0))[0])
    other = _adapters(wrap_lora(copy.deepcopy(model), RecoveryConfig(mode="lora", seed=1))[0])
    drawn = [name for name in first if "lora_A" in name]
    assert drawn and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert all(not torch.equal(first[name], other[name]) for name in drawn)


def test_two_lora_healings_of_one_seed_end_on_the_same_weights_whatever_the_random_state(compressed):
    dense, model, report = compressed
    config = tiny_recovery_config(mode="lora", max_tokens=128, learning_rate=1e-2, lora_dropout=0.0)
    healed = []
    for state in (1, 2):
        torch.manual_seed(state)
        merged, _ = recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), config, teacher=dense,
                            report=report)  # fmt: skip
        healed.append(merged.state_dict())
    assert any(not torch.equal(healed[0][k], model.state_dict()[k]) for k in healed[0])  # healing changed weights
    for name, tensor in healed[0].items():
        assert torch.equal(tensor, healed[1][name]), name


# --- B: the training loss over every step ---------------------------------------------------------------------------


def test_the_run_loss_weights_each_logged_loss_by_the_steps_it_averages():
    from optimum_flatten.recovery.phases import run_loss

    history = [{"step": 2, "loss": 4.0}, {"step": 3, "loss": 1.0}, {"step": 6, "loss": 2.0}]
    assert run_loss(history) == pytest.approx((4.0 * 2 + 1.0 + 2.0 * 3) / 6)
    # Resumed from a step that was not logged (a checkpoint written before every checkpoint was logged): the log
    # after it averages only from there, and steps 4-5 (trained before the stop, never logged) are left out.
    resumed = [{"step": 3, "loss": 1.0}, {"step": 6, "loss": 2.0}]
    assert run_loss(resumed, resumed_from=5) == pytest.approx((1.0 * 3 + 2.0) / 4)
    assert run_loss([]) is None


class Stopped(RuntimeError):
    """Stands for the process being killed."""


def _heal_stopped_then_resumed(model, dense, report, options, folder: Path, phase: int, step: int):
    """The log of a checkpointed healing stopped as phase `phase` ends step `step`, then run again (it resumes)."""

    def on_step_end(self, args, state, control, **kwargs):
        if args.output_dir.endswith(f"phase-{phase}") and state.global_step == step:
            raise Stopped(f"stopped in phase {phase} at step {step}")
        return control

    config = tiny_recovery_config(**options, checkpoint_dir=str(folder), save_every=2)
    resume_module.CheckpointState.on_step_end = on_step_end
    try:
        with pytest.raises(Stopped):
            recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), config, teacher=dense, report=report)
    finally:
        del resume_module.CheckpointState.on_step_end
    return recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), config, teacher=dense, report=report)


#: (options, phase and step to stop at). A log every 3 steps of 6, checkpoints every 2: the resumed run's first log
#: (step 6) averages from its checkpoint (step 4), the stopped run's steps after its last log were never logged.
CASES = {
    "full": ({"mode": "full", "max_tokens": 384, "learning_rate": 1e-3}, 1, 5),
    "lora": ({"mode": "lora", "max_tokens": 384, "learning_rate": 1e-2}, 1, 5),
    "local_then_global_in_phase_2": (
        {"mode": "local", "max_tokens": 256, "local_then_global_tokens": 384, "learning_rate": 1e-3}, 2, 5,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_healing_reports_the_loss_of_the_same_healing_never_stopped(case, compressed, tmp_path):
    dense, model, report = compressed
    options, phase, step = CASES[case]
    options = {**options, "heldout_rows": 2, "eval_every": 2, "patience": 0, "logging_steps": 3}
    _, resumed = _heal_stopped_then_resumed(model, dense, report, options, tmp_path / "stopped", phase, step)
    assert resumed["resumed_from_step"][phase - 1] == 4
    unstopped_config = tiny_recovery_config(**options, checkpoint_dir=str(tmp_path / "unstopped"), save_every=2)
    _, unstopped = recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), unstopped_config,
                           teacher=dense, report=report)  # fmt: skip
    assert unstopped["resumed_from_step"] == [None] * len(unstopped["resumed_from_step"])
    logs = [(resumed, unstopped)]
    if "global_phase" in unstopped:
        logs.append((resumed["global_phase"], unstopped["global_phase"]))
    for theirs, ours in logs:
        assert [h["step"] for h in theirs["loss_history"]] == [h["step"] for h in ours["loss_history"]]
        for a, b in zip(theirs["loss_history"], ours["loss_history"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-12, abs=0), a["step"]
        assert theirs["train_loss"] == pytest.approx(ours["train_loss"], rel=1e-12, abs=0)
    for theirs, ours in logs:
        # The whole entries too: nothing of the wall clock in them (the Trainer's speed metrics are left out).
        assert theirs["loss_history"] == ours["loss_history"]
        assert theirs["tokens_trained"] == ours["tokens_trained"] == theirs["positions_trained"]
    # Without checkpoints the log has no entries at them; the loss over the steps is the same but for float32 sums.
    plain = tiny_recovery_config(**options)
    _, whole = recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), plain, teacher=dense,
                       report=report)  # fmt: skip
    assert resumed["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-5)
    assert whole["loss_history"][-1]["step"] == resumed["steps"] - resumed.get("global_phase", {}).get("steps", 0)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """The folder where rank 0 of a 2-process launch of `ddp_review_record.py` left its logs."""
    out = tmp_path_factory.mktemp("ddp_record")
    launch_two_gloo_processes(Path(ddp_review_record.__file__), out, timeout=300)
    return out


def _assert_same_losses(theirs: dict, ours: dict, steps: list[int]) -> None:
    """Two records log their losses at the same `steps`, with the same values and the same mean (to float32 sums'
    order: the processes' losses are gathered, then averaged)."""
    assert [h["step"] for h in theirs["loss_history"]] == [h["step"] for h in ours["loss_history"]] == steps
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in theirs["loss_history"]], dtype=torch.float64),
        torch.tensor([h["loss"] for h in ours["loss_history"]], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert theirs["train_loss"] == pytest.approx(ours["train_loss"], rel=1e-6)


def test_two_processes_report_the_loss_and_tokens_of_one(two_processes):
    """The Trainer's `training_loss` adds the steps after its last log as this process's loss, rank 0's alone under
    DDP; the record's loss is the logged losses' (each the mean over the processes), the end of training logged."""
    theirs = torch.load(two_processes / "uninterrupted.pt")
    ours = ddp_review_record.heal(processes=1)
    assert theirs["processes"] == 2 and ours["processes"] == 1
    _assert_same_losses(theirs, ours, [3, 4])
    expected = ddp_heal.STEPS * ddp_heal.GLOBAL_BATCH * ddp_heal.SEQLEN
    assert theirs["tokens_trained"] == ours["tokens_trained"] == theirs["positions_trained"] == expected


def test_two_processes_stopped_and_resumed_report_the_loss_of_one_never_stopped(two_processes, tmp_path):
    resumed = torch.load(two_processes / "resumed.pt")
    assert resumed["processes"] == 2 and resumed["resumed_from_step"] == [2]
    ours = ddp_review_record.heal(processes=1, checkpoint_dir=str(tmp_path), save_every=ddp_review_record.SAVE_EVERY)
    _assert_same_losses(resumed, ours, [2, 3, 4])
    assert resumed["tokens_trained"] == ours["tokens_trained"]


# --- C: real tokens -------------------------------------------------------------------------------------------------


def test_tokens_trained_counts_the_real_tokens_of_padded_chat_rows():
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.chat_template = CHATML
    records = [{"messages": CONVERSATIONS[i % 2]} for i in range(12)]
    # 12 rows (one a conversation, under 128 characters), 2 a step, 6 steps: one epoch, every row trained on once.
    config = RecoveryConfig(mode="full", max_steps=6, seqlen=128, per_device_train_batch_size=2, heldout_rows=0,
                            learning_rate=1e-4, extra_training_args={"disable_tqdm": True})  # fmt: skip
    _, log = recover(tiny_models.tiny_llama_gqa(), tokenizer, records, config, teacher=False)
    texts, kind = load_recovery_texts(records, tokenizer=tokenizer)
    rows = build_training_rows(tokenizer, texts, kind, 128, None, 0)
    real = sum(int(row["attention_mask"].sum()) for row in rows)
    assert kind == "chat" and len(rows) == 12 and real < 12 * 128
    assert log["tokens_trained"] == real
    assert log["positions_trained"] == 6 * 2 * 128


def test_tokens_trained_of_packed_text_are_its_positions(compressed):
    dense, model, report = compressed
    config = tiny_recovery_config(mode="full", max_tokens=192, learning_rate=1e-3)
    _, log = recover(copy.deepcopy(model), TOKENIZER, tiny_models.sample_texts(), config, teacher=dense,
                     report=report)  # fmt: skip
    assert log["tokens_trained"] == log["positions_trained"] == 3 * 2 * 32 == log["steps"] * 2 * 32


# --- D: the teacher-text cache and the teacher folder's spelling ----------------------------------------------------


def test_the_teacher_text_cache_is_found_whatever_the_spelling_of_the_teachers_folder(tmp_path, monkeypatch):
    (tmp_path / "models" / "teacher").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "models" / "teacher", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    teacher = tiny_models.tiny_llama_gqa()
    options = dict(seed=0, batch_size=4, cache_dir=tmp_path / "cache", progress=False)
    spellings = ["models/teacher", str(tmp_path / "models" / "teacher"), "models/teacher/", "./models/../link"]
    cached = []
    for spelling in spellings:
        teacher.config._name_or_path = spelling
        cached.append(sample_teacher_rows(teacher, TOKENIZER, 4, 16, **options)[1]["cached"])
    assert cached == [False, True, True, True]
    key = json.loads((tmp_path / "cache" / "train.json").read_text())
    assert key["teacher"] == str((tmp_path / "models" / "teacher").resolve())
    teacher.config._name_or_path = "org/teacher"  # a hub id: no such folder here, kept as written
    assert not sample_teacher_rows(teacher, TOKENIZER, 4, 16, **options)[1]["cached"]
    assert json.loads((tmp_path / "cache" / "train.json").read_text())["teacher"] == "org/teacher"


# --- E: rows read back over the ranks, and a negative heldout_rows ------------------------------------------------


def _read_back_on_rank(rank: int, init: str, out: str) -> None:
    """One rank of a 2-process gloo group: samples 12 rows, 2 a batch, uninterrupted; then leaves its finished
    batches of a stopped sampling in another folder (rank 0 one batch, rank 1 two) and samples again there."""
    from optimum_flatten.recovery.teacher_text import _rank_rows

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        options = dict(seed=0, batch_size=2, progress=False)
        whole, _ = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 12, 16, cache_dir=f"{out}/whole",
                                       **options)  # fmt: skip
        torch.distributed.barrier()  # rank 0 has written the key
        key = json.loads(Path(f"{out}/whole/train.json").read_text())
        first, _ = _rank_rows(12, rank, 2)
        finished = torch.stack([row["input_ids"] for row in whole[first : first + 2 * (rank + 1)]])
        FinishedBatches.open(Path(f"{out}/stopped"), "train", key, rank, 2).save(finished, rank + 1, 2)
        torch.distributed.barrier()
        rows, record = sample_teacher_rows(tiny_models.tiny_llama_gqa(), TOKENIZER, 12, 16, cache_dir=f"{out}/stopped",
                                           **options)  # fmt: skip
        same = all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(rows, whole, strict=True))
        torch.save({"record": record, "same_rows": same}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_rows_read_back_count_every_ranks_rows(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_read_back_on_rank, args=(f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["same_rows"], rank
        assert saved["record"]["rows_read_back"] == 2 + 4 and not saved["record"]["cached"], rank


def test_a_negative_heldout_rows_is_refused_not_read_as_no_gate(compressed):
    dense, model, report = compressed
    with pytest.raises(ValueError, match=r"^heldout_rows must be at least 0 \(0 turns the gate off\), got -1\.$"):
        heldout_split(-1, 0.5)
    target = copy.deepcopy(model)
    with pytest.raises(ValueError, match="heldout_rows must be at least 0"):
        recover(target, TOKENIZER, tiny_models.sample_texts(), tiny_recovery_config(mode="full", heldout_rows=-1),
                teacher=dense, report=report)  # fmt: skip
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.state_dict().items())
    assert heldout_split(0, 0.5) == (0, 0) and heldout_split(4, 0.0) == (4, 0)
