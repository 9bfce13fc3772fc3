"""Healing texts in the forms users of HF tooling keep them: TRL's conversational ``messages`` records (written by the
tokenizer's own chat template, one row a conversation) and CSV files, through the API and `recover`'s command line."""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from common import dense_and_compressed_on_disk
from optimum_flatten.calibration.data import load_texts
from optimum_flatten.cli.main import main
from optimum_flatten.recovery import load_recovery_texts
from optimum_flatten.recovery.data import build_training_rows
from optimum_flatten.utils.errors import CalibrationDataError

#: A ChatML template, as Qwen2.5's and SmolLM2's tokenizers carry one.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two and three"},
     {"role": "assistant", "content": "five"}],
]  # fmt: skip


def _chat_tokenizer():
    tokenizer = tiny_models.tiny_hf_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def _write_jsonl(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    return str(path)


def test_chat_records_are_written_by_the_tokenizers_template_one_row_each(tmp_path):
    tokenizer = _chat_tokenizer()
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    texts, kind = load_recovery_texts(path, tokenizer=tokenizer)
    assert kind == "chat"
    assert texts == [tokenizer.apply_chat_template(m, tokenize=False) for m in CONVERSATIONS]
    rows = build_training_rows(tokenizer, texts, kind, seqlen=256, max_samples=None, seed=0)
    assert len(rows) == len(CONVERSATIONS)
    for row, turns in zip(rows, CONVERSATIONS, strict=True):
        # The naive reference: the template's own tokenisation, then EOS, then padding that no label reads.
        expected = [*tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False), tokenizer.eos_token_id]
        real = row["attention_mask"] == 1
        assert row["input_ids"][real].tolist() == expected
        assert (row["labels"][~real] == -100).all() and torch.equal(row["labels"][real], row["input_ids"][real])


def test_a_datasets_dataset_of_messages_reads_as_chat():
    datasets = pytest.importorskip("datasets")
    tokenizer = _chat_tokenizer()
    texts, kind = load_recovery_texts(datasets.Dataset.from_dict({"messages": CONVERSATIONS}), tokenizer=tokenizer)
    assert kind == "chat" and texts[1].startswith("<|im_start|>system\nbe brief<|im_end|>")


@pytest.mark.parametrize(
    "records, tokenizer, message",
    [
        ([{"messages": CONVERSATIONS[0]}, {"text": "plain"}], "chat", "record 1 has no 'messages' list"),
        ([{"messages": CONVERSATIONS[0]}, {"messages": [{"content": "no role"}]}], "chat", "record 1 has no"),
        ([{"messages": CONVERSATIONS[0]}], "plain", "the tokenizer has no chat template"),
        ([{"messages": CONVERSATIONS[0]}], None, "the tokenizer has no chat template"),
    ],
    ids=["a plain record", "a turn without a role", "no template", "no tokenizer"],
)
def test_chat_records_are_refused_in_one_line_where_they_cannot_be_written(records, tokenizer, message):
    tokenizers = {"chat": _chat_tokenizer(), "plain": tiny_models.tiny_hf_tokenizer(), None: None}
    with pytest.raises(CalibrationDataError, match=message):
        load_recovery_texts(records, tokenizer=tokenizers[tokenizer])


def test_calibration_names_chat_records_instead_of_a_missing_field(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    with pytest.raises(CalibrationDataError, match=r"are chat 'messages'.*for calibration give plain text"):
        load_texts(path)


def test_csv_files_are_read_by_their_header_with_documents_longer_than_the_csv_modules_cap(tmp_path):
    import csv

    long = "word " * 40_000  # 200,000 characters: over the csv module's default cap of 131,072 a field
    path = tmp_path / "corpus.csv"
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "content"])
        writer.writerows([["1", "first, with a comma\nand a newline"], ["2", ""], ["3", long]])
    limit = csv.field_size_limit()
    assert load_texts(str(path), text_column="content") == ["first, with a comma\nand a newline", long]
    assert csv.field_size_limit() == limit  # the cap is the process's: put back
    with pytest.raises(CalibrationDataError, match=r"has no column 'text' \(columns: \['id', 'content'\]\)"):
        load_texts(str(path))
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(CalibrationDataError, match=r"latin\.csv.*is not UTF-8 text"):
        load_texts(str(latin))


def test_alpaca_records_in_a_csv_file_are_formatted(tmp_path):
    path = tmp_path / "alpaca.csv"
    path.write_text("instruction,input,output\nName a colour.,,Blue.\nAdd them.,2 and 3,5\n", encoding="utf-8")
    texts, kind = load_recovery_texts(str(path))
    assert kind == "alpaca" and "### Input:" not in texts[0] and "### Input:\n2 and 3\n\n### Response:\n5" in texts[1]


def test_recover_on_the_command_line_heals_on_chat_records(tmp_path, capsys):
    tokenizer = _chat_tokenizer()
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tokenizer)
    records = [{"messages": CONVERSATIONS[i % 2]} for i in range(12)]
    data = _write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "healed"
    code = main(["recover", str(compressed), "--teacher", str(dense), "--dataset", data, "--seqlen", "64",
                 "--max-steps", "1", "--per-device-train-batch-size", "2", "--heldout-rows", "2", "--no-progress",
                 "--output", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["recovery"]["data_kind"] == "chat" and report["recovery"]["steps"] == 1
