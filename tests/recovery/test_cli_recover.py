"""`optimum-flatten recover --teacher ... --mode ... --max-tokens ...`: the report and card, and one-line refusals
that write nothing."""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten.cli.main import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(dense folder, compressed folder with its report, training text file), all with the tiny HF tokenizer."""
    root = tmp_path_factory.mktemp("heal")
    tokenizer = tiny_models.tiny_hf_tokenizer()
    dense = root / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    tokenizer.save_pretrained(dense)
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "flattengpt", tokenizer, num_layers_to_remove=2)
    compressed = quantizer.save(model, root / "compressed", tokenizer)
    data = root / "text.txt"
    data.write_text("\n".join(tiny_models.sample_texts(60)))
    return dense, compressed, data


def _arguments(folders, output, *extra: str) -> list[str]:
    dense, compressed, data = folders
    return [
        "recover", str(compressed), "--teacher", str(dense), "--dataset", str(data), "--output", str(output),
        "--seqlen", "32", "--per-device-train-batch-size", "2", "--heldout-rows", "4", "--eval-every", "1",
        *extra,
    ]  # fmt: skip


def test_recover_distils_the_changed_blocks_and_says_so_in_report_and_card(folders, tmp_path, capsys):
    out = tmp_path / "healed"
    assert main(_arguments(folders, out, "--max-tokens", "256", "--mode", "changed", "--learning-rate", "1e-3")) == 0
    recovery = json.loads((out / "flatten_report.json").read_text())["recovery"]
    assert recovery["mode"] == "changed" and recovery["loss"] == "distillation" and recovery["teacher"] == "dense"
    assert (
        recovery["tokens_trained"] == 64 * recovery["steps"]
        and recovery["steps"] <= 4
        and recovery["dataset"].endswith("text.txt")
    )
    assert recovery["gate"] in ("kept input weights", "kept the best trained state")
    assert set(recovery["heldout_before"]) == {"objective", "lm", "kl"}
    card = (out / "README.md").read_text()
    assert "Healing: mode `changed`, distilled from `dense`" in card and "gate:" in card
    assert f"{recovery['steps']} steps of 2 rows x 32 tokens a process)" in card  # the rows given on the command line
    assert "gate:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mode", "everything"], "invalid choice: 'everything'"),
        # The default mode after FlattenGPT's merged pairs: local for half the budget, then the global loss.
        (["--max-tokens", "1000000"], "max_tokens=500000 (the local phase of 1000000 tokens in all) needs"),
        (["--hidden-weight", "1", "--max-tokens", "64", "--teacher", "none"], "need a teacher"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(folders, tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) if extra[0] == "--mode" else _no_raise():
        code = main(_arguments(folders, out, *extra))
        assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bars: the one-line refusal
    assert message in error and error.startswith(("optimum-flatten", "error", "usage"))
    assert not out.exists()


def test_a_teacher_with_another_vocabulary_is_refused(folders, tmp_path, capsys):
    other = tmp_path / "other"
    model = tiny_models._build(tiny_models.LlamaConfig(**tiny_models._common(vocab_size=128)), seed=0)
    model.save_pretrained(other)
    tiny_models.tiny_hf_tokenizer().save_pretrained(other)
    out = tmp_path / "never"
    assert main([*_arguments(folders, out, "--max-tokens", "64"), "--teacher", str(other)]) == 2
    assert "vocabulary has 128 entries" in capsys.readouterr().err
    assert not out.exists()


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> bool:
        return False


def test_recover_with_checkpoints_says_what_they_leave_on_disk(folders, tmp_path, capsys):
    """A finished healing's checkpoints (weights and optimiser state) stay for a resume; the command says how much
    they hold and where, so that a user frees the space (a Qwen2.5-0.5B benchmark healing left 19 GB)."""
    out, checkpoints = tmp_path / "healed", tmp_path / "checkpoints"
    # A folder the user keeps other files in: they are neither counted nor advised for removal (review J).
    checkpoints.mkdir()
    (checkpoints / "notes.txt").write_text("the user's own file" * 1000)
    arguments = _arguments(folders, out, "--max-tokens", "256", "--mode", "full", "--learning-rate", "1e-3")
    assert main([*arguments, "--checkpoint-dir", str(checkpoints), "--save-every", "2"]) == 0
    recovery = json.loads((out / "flatten_report.json").read_text())["recovery"]
    held = sum(path.stat().st_size for path in (checkpoints / "phase-1").rglob("*") if path.is_file())
    assert recovery["checkpoint_bytes"] == held > 0 and str(checkpoints) not in json.dumps(recovery)  # no paths
    assert (checkpoints / "notes.txt").read_text() == "the user's own file" * 1000
    printed = capsys.readouterr().out
    assert f"checkpoints: {held / 2**30:.2f} GiB left in {checkpoints} (phase-1), needed only to resume" in printed
    assert "remove those folders once the healed model is saved" in printed


def test_recover_and_compress_read_the_text_column_they_are_given(folders, tmp_path):
    """A .jsonl of another field: `recover --text-column` and `compress --heal-text-column` read it (the refusal
    told the user to set text_column, which recover's command line had no flag for)."""
    dense, _, data = folders
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"content": t}) + "\n" for t in data.read_text().splitlines()))
    out = tmp_path / "healed"
    arguments = _arguments(folders, out, "--max-tokens", "128", "--mode", "full")
    arguments[arguments.index(str(data))] = str(rows)
    assert main(arguments) == 2  # the field is 'content', not 'text'
    assert main([*arguments, "--text-column", "content"]) == 0
    assert json.loads((out / "flatten_report.json").read_text())["recovery"]["tokens_trained"] == 128
    compress_argv = ["compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "1", "--dataset",
                     str(data), "--nsamples", "4", "--seqlen", "32", "--heal-tokens", "128", "--heal-mode", "full",
                     "--heal-dataset", str(rows), "--heal-text-column", "content", "--no-progress", "--output",
                     str(tmp_path / "compressed")]  # fmt: skip
    assert main(compress_argv) == 0


def test_a_rerun_with_other_options_is_refused_before_the_teacher_samples_and_no_progress_is_no_option(
    folders, tmp_path, capsys, monkeypatch
):
    """A checkpoint folder holds one healing and its teacher's rows. A rerun with another seed sampled its own rows
    over them (hours at 7B) before the phase's check refused it, and the interrupted job then had to sample again;
    it is refused first, naming the seed. ``--no-progress`` changes what is shown, not what is trained: a rerun with
    or without it is the same healing."""
    import optimum_flatten.recovery.rows as rows_module

    out, checkpoints = tmp_path / "healed", tmp_path / "checkpoints"
    arguments = [
        *_arguments(folders, out, "--max-tokens", "256", "--mode", "full", "--learning-rate", "1e-3"),
        *("--teacher-text", "0.5", "--checkpoint-dir", str(checkpoints), "--save-every", "2"),
    ]
    assert main([*arguments, "--no-progress"]) == 0
    cache = {path.name: path.read_bytes() for path in (checkpoints / "teacher_text").iterdir()}
    assert cache
    sampling = rows_module.sample_teacher_rows

    def refused_first(*args, **kwargs):
        raise AssertionError("the teacher sampled before the options were checked")

    with monkeypatch.context() as patch:
        patch.setattr(rows_module, "sample_teacher_rows", refused_first)
        assert main([*arguments, "--seed", "1", "--output", str(tmp_path / "other")]) == 2
    assert "(seed: 0 then, 1 now)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert {path.name: path.read_bytes() for path in (checkpoints / "teacher_text").iterdir()} == cache
    assert rows_module.sample_teacher_rows is sampling
    assert main([*arguments, "--output", str(tmp_path / "again")]) == 0  # without --no-progress: the same healing
    from safetensors.torch import load_file

    first, again = (load_file(str(folder / "model.safetensors")) for folder in (out, tmp_path / "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)  # replayed


@pytest.mark.parametrize(
    ("text", "message"),
    [("missing.txt", "does not exist"), ("empty.txt", "empty"), ("sotu:before2000", "sotu:before-2000")],
    ids=["missing", "empty", "misspelt-bundled"],
)
def test_recover_refuses_a_text_it_cannot_read_before_loading_a_model(folders, tmp_path, capsys, monkeypatch, text,
                                                                     message):  # fmt: skip
    """Review J: a missing --dataset was refused only after the student had loaded (compress checked it first)."""

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded although the text could be refused first")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", never)
    (tmp_path / "empty.txt").write_text("")
    dataset = str(tmp_path / text) if text.endswith(".txt") else text
    arguments = _arguments(folders, tmp_path / "healed", "--max-tokens", "256")
    arguments[arguments.index("--dataset") + 1] = dataset
    assert main(arguments) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "healed").exists()
