"""`optimum-flatten layer-collapse` as users run it: the data forms its help names (Alpaca and chat records, a text
column of their own) train *and* calibrate; whatever would be refused after the training is refused before it (too
few calibration tokens, a one-token row, rates of zero, a seed or a sample count out of range, an encoder-decoder);
a diverged training saves nothing; an MLP prepared by an earlier run is named in what the command prints."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import main
from tests.recovery.test_chat_and_csv import CHATML, CONVERSATIONS

#: A short schedule: enough steps to take α to 1 on a tiny GPT-2.
SCHEDULE = ["--pull-steps", "6", "--pull-per-step", "0.5", "--snap-steps", "2", "--batch-size", "2", "--seqlen", "16"]


@pytest.fixture
def gpt2(tmp_path):
    """A tiny GPT-2 with a real tokenizer (and a chat template) on disk."""
    path = tmp_path / "gpt2"
    tiny_models.tiny_gpt2().save_pretrained(path)
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("\n".join(tiny_models.sample_texts(40)))
    return path


@pytest.fixture
def no_training(monkeypatch):
    import optimum_flatten.methods.layer_collapse as layer_collapse

    monkeypatch.setattr(layer_collapse, "train_to_linear", lambda *a, **k: pytest.fail("trained before refusing"))


def _records(tmp_path, kind: str) -> str:
    texts = tiny_models.sample_texts(40)
    if kind == "alpaca":
        records = [{"instruction": t[:40], "input": "", "output": t} for t in texts]
    elif kind == "chat":
        records = [{"messages": m} for m in CONVERSATIONS * 20]
    else:  # plain text under a column of the user's own name
        records = [{"body": t} for t in texts]
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


@pytest.mark.parametrize("kind", ["alpaca", "chat", "column"])
def test_the_records_it_trains_on_are_the_ones_it_calibrates_on(gpt2, tmp_path, capsys, kind):
    """Alpaca and chat records used to train for the whole schedule and then be refused by the collapse's
    calibration (which read only a 'text' field); a text column of the user's own had no flag at all."""
    column = ["--text-column", "body"] if kind == "column" else []
    out = tmp_path / "out"
    argv = ["layer-collapse", str(gpt2), "--dataset", _records(tmp_path, kind), *column, "--num-mlps", "1",
            "--nsamples", "2", *SCHEDULE, "--output", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "flatten_report.json").read_text())
    assert [r["layer"] for r in report["layer_collapse"]["collapsed"]] == [5]
    training = report["training"]
    assert training["text_kind"] == {"column": "text"}.get(kind, kind)
    assert training["selection"] == {"num_mlps": 1} and training["prepared"] == [5]
    assert training["rows_read"] == (6 + 2) * 2
    card = (out / "README.md").read_text()  # the card says the weights were trained, on what
    assert f"6 pull + 2 snap steps on {kind}.jsonl" in card and "16 row reads" in card


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nsamples", "5000"], "fewer than nsamples"),
        (["--seqlen", "1"], "--seqlen must be at least 2"),
        (["--learning-rate", "0"], "learning_rate must be a positive"),
        (["--snap-learning-rate", "nan"], "snap_learning_rate must be a positive"),
        (["--max-samples", "0"], "--max-samples must be at least 1"),
        (["--seed", "-1"], "seed must be in"),
        (["--logging-steps", "-2"], "logging_steps must be at least 1"),
        (["--num-mlps", "0"], "num_mlps must be a positive"),
    ],
    ids=["calibration tokens", "one-token rows", "zero rate", "nan rate", "no rows", "seed", "logging", "no MLP"],
)
def test_what_would_fail_after_the_training_is_refused_before_it(gpt2, text, tmp_path, capsys, no_training, options,
                                                                 message):  # fmt: skip
    flags = {o for o in options if o.startswith("--")}
    base = [o for pair in zip(SCHEDULE[::2], SCHEDULE[1::2], strict=True) if pair[0] not in flags for o in pair]
    selection = [] if "--num-mlps" in flags else ["--num-mlps", "1"]
    argv = ["layer-collapse", str(gpt2), "--dataset", str(text), *selection, *base, *options,
            "--output", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 2 and message in one_error_line(capsys) and not (tmp_path / "o").exists()


def test_float16_whose_gradients_overflow_is_not_offered(gpt2, text, tmp_path, capsys, no_training):
    argv = ["layer-collapse", str(gpt2), "--dataset", str(text), "--num-mlps", "1", "--dtype", "float16",
            "--output", str(tmp_path / "o")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_data_file_it_cannot_read_is_refused_before_the_model_loads(gpt2, tmp_path, capsys, monkeypatch):
    import optimum_flatten.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    records = tmp_path / "other.jsonl"
    records.write_text(json.dumps({"body": "words"}))
    argv = ["layer-collapse", str(gpt2), "--dataset", str(records), "--num-mlps", "1", "--output", str(tmp_path / "o")]
    assert main(argv) == 2 and "text_column" in one_error_line(capsys)
    argv[3] = str(tmp_path / "missing.jsonl")
    assert main(argv) == 2 and "missing.jsonl" in one_error_line(capsys)


def test_an_encoder_decoder_is_refused_as_not_a_causal_lm(tmp_path, text, capsys, no_training):
    marian = tmp_path / "marian"
    tiny_models.tiny_marian().save_pretrained(marian)
    tiny_models.tiny_hf_tokenizer().save_pretrained(marian)
    argv = ["layer-collapse", str(marian), "--dataset", str(text), "--num-mlps", "1", "--output", str(tmp_path / "o")]
    assert main(argv) == 2 and "encoder-decoder" in one_error_line(capsys)


def test_a_training_that_diverges_saves_nothing(gpt2, text, tmp_path, capsys, monkeypatch):
    import optimum_flatten.methods.layer_collapse as layer_collapse

    def diverged(model, rows, schedule):
        return {"rows": len(rows), "snap": {"alpha_after": [math.nan], "train_loss": math.nan}}

    monkeypatch.setattr(layer_collapse, "train_to_linear", diverged)
    argv = ["layer-collapse", str(gpt2), "--dataset", str(text), "--num-mlps", "1", *SCHEDULE,
            "--output", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 2 and "diverged" in one_error_line(capsys) and not (tmp_path / "o").exists()


def test_an_mlp_an_earlier_run_prepared_is_named_with_the_selection(gpt2, text, tmp_path, capsys):
    """A checkpoint saved mid-training carries α on MLPs of its own: they train and collapse with the selection,
    and the table and the report say so instead of listing only the MLP asked for."""
    from transformers import AutoModelForCausalLM

    from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_, save_layer_collapse

    model = AutoModelForCausalLM.from_pretrained(gpt2)
    for activation in prepare_layer_collapse_(model, num_mlps=2).values():
        with torch.no_grad():
            activation.alpha.fill_(0.5)
    middle = tmp_path / f"{tmp_path.name}-mid"
    save_layer_collapse(model, middle)
    tiny_models.tiny_hf_tokenizer().save_pretrained(middle)
    out = tmp_path / "out"
    argv = ["layer-collapse", str(middle), "--trust-remote-code", "--dataset", str(text), "--num-mlps", "1",
            "--nsamples", "2", *SCHEDULE, "--output", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert "[5], and [4] prepared by an earlier run" in capsys.readouterr().out
    training = json.loads((out / "flatten_report.json").read_text())["training"]
    assert training["prepared"] == [5] and training["prepared_earlier"] == [4]


def test_a_stock_checkpoint_counts_the_parameters_it_holds(gpt2, text, tmp_path, capsys):
    """Every MLP collapsed saves as a plain GPT-2 with an identity down map per MLP (d² + d each), which the model in
    memory does not hold: the printed table and the card used to give the in-memory count (39,680 for 46,016 saved on
    this model), and the card's options read ``num_mlps: None`` with no word of the selection that was trained."""
    from transformers import GPT2LMHeadModel

    from optimum_flatten.utils.torch_utils import count_parameters

    out = tmp_path / "out"
    argv = ["layer-collapse", str(gpt2), "--dataset", str(text), "--num-mlps", "6", "--nsamples", "2", *SCHEDULE,
            "--output", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["export_format"] == "stock"
    saved = count_parameters(GPT2LMHeadModel.from_pretrained(out))
    assert saved == report["parameters_after"] + report["stock_identity_parameters"] > report["parameters_after"]
    said = f"{report['parameters_before']:,} -> {saved:,} as saved"
    card = (out / "README.md").read_text()
    assert said in printed and said in card
    assert "Trained to linear before the collapse: the MLPs of layers [0, 1, 2, 3, 4, 5] (num_mlps=6)" in card
