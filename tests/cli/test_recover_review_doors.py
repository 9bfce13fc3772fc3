"""`optimum-flatten recover` where a review found it wrong: a state folder inside the teacher's or the student's
folder (which the command then advised to remove), options that were ignored or clamped without a word (two
budgets, zero steps or epochs, a negative held-out count, a global scope outside mode local, embeddings under LoRA,
distillation weights with no teacher), one-token rows, ``--mode none`` as documented, chat records with no content,
a missing prompts or guard file named by its own flag, and the teacher's sampling bar under ``--no-progress``."""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import build_parser, main


@pytest.fixture
def no_training(monkeypatch):
    """Makes the healing itself fail the test: what is refused must be refused before it."""
    import optimum_flatten.recovery.trainer as trainer

    monkeypatch.setattr(trainer, "run_phases", lambda *a, **k: pytest.fail("trained before refusing"))


def _recover(dense, compressed, text, tmp_path, *options: str) -> list[str]:
    """The command with `options`; ``--seqlen`` and the budget ``--max-tokens`` take the defaults below unless
    `options` give them (``--max-steps`` alone leaves the token budget out)."""
    given = set(options[::2])
    base = {"--seqlen": "32", "--max-tokens": "256"}
    if "--max-steps" in given:
        base.pop("--max-tokens")
    defaults = [item for flag, value in base.items() if flag not in given for item in (flag, value)]
    return ["recover", str(compressed), "--teacher", str(dense), "--dataset", str(text), *defaults,
            "--output", str(tmp_path / "out"), *options]  # fmt: skip


@pytest.mark.parametrize("option", ["--checkpoint-dir", "--teacher-text-cache"])
@pytest.mark.parametrize("where", ["dense", "compressed"])
def test_a_state_folder_in_a_model_folder_is_refused_before_any_work(pair, tmp_path, capsys, monkeypatch, option,
                                                                     where):  # fmt: skip
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    dense, compressed, text = pair
    folder = {"dense": dense, "compressed": compressed}[where]
    before = sorted(p.name for p in folder.iterdir())
    state = folder / "state" if where == "compressed" else folder
    assert main(_recover(dense, compressed, text, tmp_path, option, str(state))) == 2
    assert option in (message := one_error_line(capsys)) and "of the model" in message
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize(
    "options, message",
    [
        (["--seqlen", "1"], "seqlen must be at least 2"),
        (["--max-steps", "5", "--max-tokens", "256"], "not both"),
        (["--max-steps", "0"], "max_steps must be a positive"),
        (["--num-train-epochs", "0"], "num_train_epochs must be a positive"),
        (["--heldout-rows", "-1"], "heldout_rows must be at least 0"),
        (["--mode", "full", "--global-scope", "all"], "global_scope chooses"),
        (["--mode", "lora", "--train-embeddings", "true"], "train_embeddings=True would do nothing"),
    ],
    ids=["one-token rows", "two budgets", "zero steps", "zero epochs", "negative held-out", "global scope", "lora"],
)
def test_options_that_were_ignored_or_clamped_are_refused(pair, tmp_path, capsys, no_training, options, message):
    dense, compressed, text = pair
    assert main(_recover(dense, compressed, text, tmp_path, *options)) == 2 and message in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_distillation_weights_without_a_teacher_are_refused(pair, tmp_path, capsys, no_training):
    dense, compressed, text = pair
    argv = _recover(dense, compressed, text, tmp_path, "--kd-alpha", "0.5")
    argv[argv.index("--teacher") + 1] = "none"
    assert main(argv) == 2 and "there is no teacher" in one_error_line(capsys)


def test_mode_none_as_documented_takes_the_default_mode(tmp_path):
    args = build_parser().parse_args(["recover", "x", "--output", str(tmp_path / "o"), "--mode", "none"])
    assert args.mode is None


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"messages": []}], "record 0 has a 'messages' field but no"),
        ([{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]}], "with some content"),
    ],
    ids=["empty list", "empty turns"],
)
def test_chat_records_with_nothing_to_train_on_are_refused(pair, tmp_path, capsys, no_training, records, message):
    dense, compressed, _ = pair
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in records * 4))
    assert main(_recover(dense, compressed, chat, tmp_path)) == 2 and message in one_error_line(capsys)


@pytest.mark.parametrize("option", ["--prompts", "--guard-text"])
def test_a_missing_prompts_or_guard_file_is_named_by_its_flag(pair, tmp_path, capsys, no_training, option):
    dense, compressed, text = pair
    extra = ["--teacher-text", "0.5", "--teacher-prompt-tokens", "8"] if option == "--prompts" else []
    argv = _recover(dense, compressed, text, tmp_path, *extra, option, str(tmp_path / "nope.txt"))
    assert main(argv) == 2 and f"({option})" in (message := one_error_line(capsys)) and "nope.txt" in message


def test_no_progress_hides_the_teachers_sampling_bar(pair, tmp_path, capsys):
    dense, compressed, _ = pair
    argv = ["recover", str(compressed), "--teacher", str(dense), "--dataset", "teacher", "--seqlen", "32",
            "--max-tokens", "64", "--heldout-rows", "1", "--output", str(tmp_path / "out"),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "teacher text" not in capsys.readouterr().err


def test_a_foreign_teacher_is_said_once(pair, tmp_path, capsys, caplog):
    """A teacher that is not the model the checkpoint was compressed from is allowed, with one warning: it was both
    a warning and a log record, and the command line printed the same line twice."""
    import torch

    _, compressed, text = pair
    foreign = tmp_path / "foreign"
    model = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)  # another fine-tune of the same architecture and tokenizer
    model.save_pretrained(foreign)
    tiny_models.tiny_hf_tokenizer().save_pretrained(foreign)
    with pytest.warns(UserWarning, match="not the model this checkpoint was compressed from") as said:
        assert main(_recover(foreign, compressed, text, tmp_path, "--no-progress")) == 0, capsys.readouterr().err
    assert len([w for w in said if "not the model" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "not the model" in r.getMessage()]


@pytest.mark.parametrize("kind", ["bert", "marian"])
def test_a_teacher_that_is_not_a_causal_lm_is_refused_before_it_loads(pair, tmp_path, capsys, no_training, kind):
    """AutoModelForCausalLM loads a BERT masked LM as a BertLMHeadModel that sees the tokens it predicts, and Marian
    as a decoder with a fresh head: the healing ran and saved against either (the student alone was checked)."""
    dense, compressed, text = pair
    teacher = tmp_path / kind
    model = tiny_models.tiny_bert() if kind == "bert" else tiny_models.tiny_marian()
    model.config.vocab_size = tiny_models.tiny_hf_tokenizer().vocab_size  # not refused for its vocabulary instead
    model.save_pretrained(teacher)
    argv = _recover(dense, compressed, text, tmp_path)
    argv[argv.index("--teacher") + 1] = str(teacher)
    assert main(argv) == 2
    message = one_error_line(capsys)
    assert "the teacher must be a causal language model" in message and str(teacher) in message
    assert not (tmp_path / "out").exists()


def test_a_loaded_teacher_that_is_not_a_causal_lm_is_refused():
    from optimum_flatten.recovery.teacher import load_teacher

    with pytest.raises(ValueError, match=r"is a BertForMaskedLM, not a causal language model"):
        load_teacher(tiny_models.tiny_bert(), torch.float32)


def test_recover_dtype_float32_heals_a_bfloat16_checkpoint_in_float32(pair, tmp_path, capsys):
    """The command loaded a checkpoint in its own dtype, so a bfloat16 one could only heal in bfloat16."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dense, compressed_dir, text = pair
    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(compressed_dir).to(torch.bfloat16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json", "flatten_report.json"):
        if (compressed_dir / name).exists():
            (half / name).write_bytes((compressed_dir / name).read_bytes())
    base = ["recover", str(half), "--teacher", str(dense), "--dataset", str(text), "--seqlen", "32",
            "--max-tokens", "256", "--mode", "full", "--no-progress"]  # fmt: skip
    assert main([*base, "--dtype", "float16", "--output", str(tmp_path / "f16")]) == 2
    assert "float16 weights in place" in one_error_line(capsys) and not (tmp_path / "f16").exists()
    assert main([*base, "--dtype", "float32", "--output", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as saved:
        assert {saved.get_slice(k).get_dtype() for k in saved.keys()} == {"F32"}
    recovery = json.loads((tmp_path / "out" / "flatten_report.json").read_text())["recovery"]
    assert not any("most steps will be lost" in note for note in recovery.get("notes", []))
