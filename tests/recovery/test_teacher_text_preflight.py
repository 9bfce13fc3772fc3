"""What a healing on the teacher's text settles before it changes a weight, and what it holds out: the prompts and
the start refused before any module or flag changes (by `recover` and by compress-and-heal), the loops' mask only
where it applies, held-out rows on prompts no training row continues, and the memory check read on the device the
Trainer will train on."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from common import SMALL_HEALING as SMALL
from common import compress, tiny_config
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.quantizer import FlattenQuantizer
from optimum_flatten.recovery import footprint, recover
from optimum_flatten.recovery.footprint import (
    ACCELERATOR_STATE_FACTOR,
    full_fits,
    full_footprint,
    teacher_bytes_to_load,
    training_device,
    weight_bytes,
)
from optimum_flatten.recovery.rows import (
    UNGUARDED_NOTE,
    _sample_teacher_part,
    _TeacherRows,
    check_teacher_text_options,
    unguarded_notes,
)
from optimum_flatten.utils.errors import CalibrationDataError

TOKENIZER = tiny_models.CharTokenizer()
#: Documents of 20 characters and more (the tiny tokenizer's tokens are characters), each its own opening.
PROMPTS = [f"{word} of the union is strong and free" for word in ("state", "peace", "work", "bread", "law", "land")]


def _state(model: torch.nn.Module) -> tuple[int, dict[str, bool], dict[str, torch.Tensor]]:
    """(modules, each parameter's requires_grad, a copy of the weights): what a refusal must leave as it was."""
    named = dict(model.named_parameters())
    return (
        len(list(model.modules())),
        {k: p.requires_grad for k, p in named.items()},
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def _same(model: torch.nn.Module, before: tuple[int, dict[str, bool], dict[str, torch.Tensor]]) -> bool:
    modules, flags, weights = _state(model)
    same_weights = weights.keys() == before[2].keys() and all(torch.equal(v, before[2][k]) for k, v in weights.items())
    return modules == before[0] and flags == before[1] and same_weights


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_prompts_too_short_are_refused_before_recover_wraps_or_unfreezes_the_model(tmp_path, mode):
    pytest.importorskip("peft")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("too short\nalso short\n")
    model = tiny_models.tiny_llama_gqa(seed=1)
    model.requires_grad_(False)  # a frozen model stays frozen: `full` would turn every flag on
    before = _state(model)
    config = RecoveryConfig(mode=mode, max_tokens=128, prompts=str(prompts), teacher_prompt_tokens=16, **SMALL)
    with pytest.raises(CalibrationDataError, match="no prompt holds 16 tokens") as refused:
        recover(model, TOKENIZER, "teacher", config, teacher=tiny_models.tiny_llama_gqa())
    assert "\n" not in str(refused.value) and _same(model, before)


def test_a_chat_start_without_a_template_is_refused_before_recover_changes_the_model():
    model = tiny_models.tiny_llama_gqa(seed=1)
    model.requires_grad_(False)
    before = _state(model)
    config = RecoveryConfig(mode="full", max_tokens=128, sampling_start="chat", **SMALL)
    with pytest.raises(CalibrationDataError, match="needs a tokenizer with a chat template"):
        recover(model, tiny_models.tiny_hf_tokenizer(), "teacher", config, teacher=tiny_models.tiny_llama_gqa())
    assert _same(model, before)


def test_compress_refuses_prompts_too_short_before_the_compression(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("too short\n")
    heal = {**SMALL, "heldout_rows": 2, "max_tokens": 128, "mode": "full", "dataset": "teacher",
            "prompts": str(prompts), "teacher_prompt_tokens": 16}  # fmt: skip
    model = tiny_models.tiny_llama_gqa()
    before = _state(model)
    with pytest.raises(CalibrationDataError, match="no prompt holds 16 tokens"):
        compress(model, "flattengpt", TOKENIZER, num_layers_to_remove=2, heal=heal)
    assert len(model.model.layers) == 6 and _same(model, before)


@pytest.mark.parametrize(
    "options, share, message",
    [
        (dict(teacher_text_loops="mask"), 0.0, "samples none"),
        (dict(teacher_text_loops="mask", mode="local"), 1.0, "mode 'local' and the hidden-state terms"),
        (dict(teacher_text_loops="mask", mode="full", hidden_weight=1.0), 0.5, "hidden-state terms"),
        # How the teacher samples, given where it samples nothing: ignored silently before.
        (dict(prompts="missing.txt"), 0.0, "prompts='missing.txt' sets how the teacher samples .* samples none"),
        (dict(sampling_temperature=0.7, sampling_start="random"), 0.0, "sampling_temperature=0.7, sampling_start="),
    ],
    ids=["no teacher text", "local", "hidden terms", "prompts", "sampling"],
)
def test_the_loops_mask_and_sampling_options_are_refused_where_nothing_would_read_them(options, share, message):
    with pytest.raises(ValueError, match=message) as refused:
        check_teacher_text_options(TOKENIZER, RecoveryConfig(**options), share)
    assert "\n" not in str(refused.value)
    check_teacher_text_options(TOKENIZER, RecoveryConfig(teacher_text_loops="mask", mode="full"), 1.0)


def _openings(rows: list[dict[str, torch.Tensor]], width: int) -> set[tuple[int, ...]]:
    return {tuple(row["input_ids"][1 : 1 + width].tolist()) for row in rows}


def test_held_out_rows_continue_prompts_no_training_row_continues_and_score_only_the_teachers_tokens():
    """A prompt's tokens are trained on as part of its rows: a held-out row on a training row's prompt would be part
    trained text. The held-out rows take prompts of their own, and their start and prompt carry no label."""
    config = RecoveryConfig(prompts=PROMPTS, teacher_prompt_tokens=12, teacher_text=1.0, **SMALL)
    plan = _TeacherRows(share=1.0, train=8, heldout=3, user=0)
    train, heldout, record = _sample_teacher_part(tiny_models.tiny_llama_gqa(), TOKENIZER, config, plan, False)
    opening = 1 + 12  # the BOS token and the prompt
    assert record["opening_tokens"] == opening and record["heldout"]["rows"] == 3
    trained, held = _openings(train, 12), _openings(heldout, 12)
    assert len(trained) == 3 and len(held) == 3 and not trained & held  # six prompts: half of them, three rows
    assert all(torch.equal(row["labels"], row["input_ids"]) for row in train)  # the training rows are unchanged
    for row in heldout:
        assert (row["labels"][:opening] == -100).all()
        assert torch.equal(row["labels"][opening:], row["input_ids"][opening:])


def test_one_prompt_serves_both_parts_and_the_held_out_rows_skip_it():
    config = RecoveryConfig(prompts=PROMPTS[:1], teacher_prompt_tokens=12, teacher_text=1.0, **SMALL)
    plan = _TeacherRows(share=1.0, train=4, heldout=2, user=0)
    train, heldout, _ = _sample_teacher_part(tiny_models.tiny_llama_gqa(), TOKENIZER, config, plan, False)
    assert _openings(train, 12) == _openings(heldout, 12)
    assert all((row["labels"][:13] == -100).all() for row in heldout)


def test_a_mix_that_holds_out_none_of_the_users_rows_says_it_is_unguarded():
    assert unguarded_notes(RecoveryConfig(heldout_rows=1, teacher_text=0.7), 0.7) == [UNGUARDED_NOTE]
    assert unguarded_notes(RecoveryConfig(heldout_rows=4, teacher_text=0.7), 0.7) == []
    assert unguarded_notes(RecoveryConfig(heldout_rows=4), 1.0) == [UNGUARDED_NOTE]
    assert unguarded_notes(RecoveryConfig(heldout_rows=0), 1.0) == []
    assert unguarded_notes(RecoveryConfig(heldout_rows=1, teacher_text=0.7, guard_text="guard.txt"), 0.7) == []


def test_compress_and_heal_on_the_teacher_text_counts_its_sampling_in_the_memory_check():
    config = tiny_config("flattengpt", num_layers_to_remove=2, heal={**SMALL, "max_tokens": 128, "dataset": "teacher"})
    dataset, _, recovery, _ = FlattenQuantizer(config, progress=False)._heal_inputs(tiny_models.tiny_llama_gqa())
    assert dataset == "teacher" and recovery.teacher_text == 1.0


def test_the_memory_check_reads_the_gpu_the_trainer_will_move_a_cpu_model_onto(monkeypatch):
    """`optimum-flatten recover` loads the model on the CPU and the Trainer trains it on this process's GPU: the
    footprint is that GPU's (the accelerator's factor, the student's weights moved there) and so is the free memory
    it is checked against; the CPU's stays where the run asks for it or there is no GPU."""
    model = tiny_models.tiny_llama_gqa()
    config = RecoveryConfig(seqlen=32)
    assert training_device(model, config) == torch.device("cpu")  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device(model, config) == torch.device("cuda", 0)
    assert training_device(model, RecoveryConfig(extra_training_args={"use_cpu": True})) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device(model, config) == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    read = []
    monkeypatch.setattr(footprint, "available_bytes", lambda device: read.append(torch.device(device)) or 2**40)
    fits, line = full_fits(model, config, teacher_bytes=0)
    expected = full_footprint(model, config, 0, accelerator=True)
    assert fits and read == [torch.device("cuda", 0)] and "free on cuda:0" in line
    assert expected.state == ACCELERATOR_STATE_FACTOR * weight_bytes(model)
    assert f"{weight_bytes(model) / 2**30:.1f} of it for the student's weights moved there" in line
    moved = weight_bytes(model)  # with just that much free beyond the footprint's share, it does not fit
    assert not full_fits(model, config, 0, available=int(expected.total / 0.9) + moved - 1)[0]
    assert full_fits(model, config, 0, available=int(expected.total / 0.9) + moved + 16)[0]
    teacher = tiny_models.tiny_llama_gqa()
    assert teacher_bytes_to_load(model, teacher, None, torch.device("cuda", 0)) == weight_bytes(teacher)
    assert teacher_bytes_to_load(model, teacher, None, torch.device("cpu")) == 0


def test_a_table_of_prompts_is_read_in_the_healing_texts_column(tmp_path):
    """--prompts prompts.jsonl with --text-column content: the prompts are that column's documents, checked before any
    change and sampled from, as the same documents given as a list."""
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"content": text}) + "\n" for text in PROMPTS))
    config = RecoveryConfig(prompts=str(path), teacher_prompt_tokens=12, teacher_text=1.0, **SMALL)
    check_teacher_text_options(TOKENIZER, config, 1.0, "content")
    with pytest.raises(CalibrationDataError, match="no field 'text'"):
        check_teacher_text_options(TOKENIZER, config, 1.0)
    plan = _TeacherRows(share=1.0, train=8, heldout=3, user=0)
    teacher = tiny_models.tiny_llama_gqa()
    from_table = _sample_teacher_part(teacher, TOKENIZER, config, plan, False, "content")
    listed = RecoveryConfig(prompts=PROMPTS, teacher_prompt_tokens=12, teacher_text=1.0, **SMALL)
    from_list = _sample_teacher_part(teacher, TOKENIZER, listed, plan, False)
    for part in (0, 1):
        assert [r["input_ids"].tolist() for r in from_table[part]] == [r["input_ids"].tolist() for r in from_list[part]]
