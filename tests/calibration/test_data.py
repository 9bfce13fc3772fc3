import json

import pytest
import torch

from optimum_flatten import CalibrationConfig
from optimum_flatten.calibration import build_calibration_batches, load_texts
from optimum_flatten.utils.errors import CalibrationDataError
from tiny_models import CharTokenizer


def test_packing_cuts_non_overlapping_windows_from_the_stream():
    texts = [" ".join(str(i) for i in range(20)), " ".join(str(i) for i in range(20, 40))]
    config = CalibrationConfig(dataset=texts, nsamples=4, seqlen=20, batch_size=3, seed=1)
    batches = build_calibration_batches(CharTokenizer(), config)
    assert [b.input_ids.shape for b in batches] == [(3, 20), (1, 20)]
    assert all(bool(b.attention_mask.all()) for b in batches)
    tokenizer = CharTokenizer()
    stream = tokenizer(texts[0])["input_ids"] + [2] + tokenizer(texts[1])["input_ids"] + [2]
    windows = {tuple(stream[i * 20 : (i + 1) * 20]) for i in range(len(stream) // 20)}
    rows = [tuple(r.tolist()) for b in batches for r in b.input_ids]
    assert len(set(rows)) == 4 and set(rows) <= windows
    # Seeded: same seed, same windows; another seed, another choice.
    again = build_calibration_batches(CharTokenizer(), config)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again, strict=True))


def test_too_little_text_says_how_much_was_found():
    config = CalibrationConfig(dataset=["short text"], nsamples=4, seqlen=64)
    with pytest.raises(CalibrationDataError, match=r"holds 11 tokens, fewer than nsamples x seqlen = 4 x 64 = 256"):
        build_calibration_batches(CharTokenizer(), config)


def test_unpacked_rows_are_padded_and_masked():
    texts = ["a" * 5, "b" * 30, "c" * 12]
    config = CalibrationConfig(dataset=texts, nsamples=3, seqlen=16, packing=False, batch_size=8)
    (batch,) = build_calibration_batches(CharTokenizer(), config)
    assert batch.attention_mask.sum(dim=1).tolist() == [5, 16, 12]
    assert (batch.input_ids[batch.attention_mask == 0] == CharTokenizer.pad_token_id).all()


def test_missing_tokenizer_is_a_clear_error():
    with pytest.raises(CalibrationDataError, match="needs a tokenizer"):
        build_calibration_batches(None, CalibrationConfig(dataset=["x"]))


def test_file_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first text")
    (tmp_path / "b.txt").write_text("second text")
    assert load_texts(str(tmp_path)) == ["first text", "second text"]
    assert load_texts(str(tmp_path / "a.txt")) == ["first text"]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps({"content": t}) for t in ["x y", "z"]))
    assert load_texts(str(jsonl), text_column="content") == ["x y", "z"]
    with pytest.raises(CalibrationDataError, match="no field 'text'"):
        load_texts(str(jsonl))
    as_json = tmp_path / "data.json"
    as_json.write_text(json.dumps([{"text": "u"}, {"text": "v"}]))
    assert load_texts(str(as_json)) == ["u", "v"]
    with pytest.raises(CalibrationDataError, match="does not exist"):
        load_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(CalibrationDataError, match="no non-empty text"):
        load_texts(["", "  "])


def test_dataset_like_objects_use_the_text_column():
    class FakeDataset:
        column_names = ("text", "id")

        def __getitem__(self, key):
            return {"text": ["one", "two"], "id": [1, 2]}[key]

    assert load_texts(FakeDataset()) == ["one", "two"]
    with pytest.raises(CalibrationDataError, match="no column 'body'"):
        load_texts(FakeDataset(), text_column="body")


def test_a_malformed_json_file_is_named_with_its_position(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text('[{"text": "one"}, {"text": }]', encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=r"calib\.json.*is not valid JSON .* line 1, column 28"):
        load_texts(str(path))


def test_a_jsonl_file_in_another_encoding_is_named(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(CalibrationDataError, match=r"calib\.jsonl.*is not UTF-8 text"):
        load_texts(str(path))


def test_recovery_data_names_a_malformed_record(tmp_path):
    from optimum_flatten.recovery import load_recovery_texts

    path = tmp_path / "alpaca.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b\x02"}\n', encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=r"line 2 of .*alpaca\.jsonl"):
        load_recovery_texts(str(path))


def test_a_fast_tokenizer_encodes_the_texts_in_chunks_to_the_same_stream_as_one_call_a_text(monkeypatch):
    import optimum_flatten.calibration.tokens as data
    from optimum_flatten.evaluation import tokenize_corpus
    from tiny_models import sample_texts, tiny_hf_tokenizer

    tokenizer = tiny_hf_tokenizer()
    assert tokenizer.is_fast
    texts = sample_texts(num=7, seed=3)
    one_a_text = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    monkeypatch.setattr(data, "TOKENIZE_CHUNK_TEXTS", 3)  # chunks of 3, 3 and 1: the seams are crossed
    calls = []
    original = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        calls.append(text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    assert list(data.tokenize_texts(tokenizer, texts)) == one_a_text
    assert [len(c) for c in calls] == [3, 3, 1]  # one call a chunk, each a list of texts
    expected = [i for ids in one_a_text for i in [*ids, tokenizer.eos_token_id]]
    assert data.token_stream(tokenizer, texts).tolist() == expected
    assert tokenize_corpus(tokenizer, texts).tolist() == expected
    # A tokenizer not known to take a list is called once a text, with the same stream.
    char = CharTokenizer()
    expected = [i for t in texts for i in [*char(t)["input_ids"], char.eos_token_id]]
    assert data.token_stream(char, texts).tolist() == expected


def test_every_form_of_a_datasets_dataset_reads_its_text_column(tmp_path):
    """What `load_dataset` gives a user: a Dataset, a DatasetDict (no split= given), a streamed IterableDataset and
    one from a generator (no column names until read); a dict of several splits is refused, naming them."""
    import datasets

    from optimum_flatten.calibration.data import is_image_dataset

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"content": f"text {i}"}) + "\n" for i in range(3)))
    expected = ["text 0", "text 1", "text 2"]
    whole = datasets.load_dataset("json", data_files=str(path))
    forms = {
        "Dataset": whole["train"],
        "DatasetDict": whole,
        "streamed": datasets.load_dataset("json", data_files=str(path), split="train", streaming=True),
        "generator": datasets.IterableDataset.from_generator(lambda: iter([{"content": t} for t in expected])),
    }
    for name, dataset in forms.items():
        assert load_texts(dataset, text_column="content") == expected, name
        assert not is_image_dataset(dataset, "content"), name
    with pytest.raises(CalibrationDataError, match="a record in 'the dataset' has no field 'text'"):
        load_texts(forms["generator"])
    two = datasets.DatasetDict({"train": whole["train"], "test": whole["train"]})
    with pytest.raises(CalibrationDataError, match=r"a DatasetDict with the splits \['test', 'train'\]; pass one"):
        load_texts(two, text_column="content")


def test_records_nulls_and_encodings_are_read_or_refused_in_one_line(tmp_path):
    """A list of records reads its text field (it was taken for images); a parquet file without the column names
    the columns, and its nulls are no text (they became the word 'None'); a .txt file that is not UTF-8 is refused
    as a .jsonl one is (it was read with replacement characters)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from optimum_flatten.calibration.data import is_image_dataset

    records = [{"text": "one"}, {"text": "two"}]
    assert load_texts(records) == ["one", "two"] and not is_image_dataset(records)
    with pytest.raises(CalibrationDataError, match="a record in 'the list' has no field 'body'"):
        load_texts(records, text_column="body")
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"content": ["one", None, "two"]}), table)
    assert load_texts(str(table), text_column="content") == ["one", "two"]
    with pytest.raises(CalibrationDataError, match=r"has no column 'text' \(columns: \['content'\]\)"):
        load_texts(str(table))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(CalibrationDataError, match=r"latin\.txt.*is not UTF-8 text"):
        load_texts(str(latin))


def test_alpaca_records_are_checked_one_by_one_and_read_inside_a_data_field(tmp_path):
    from optimum_flatten.recovery import load_recovery_texts

    mixed = [{"instruction": "a", "output": "b"}, {"text": "plain"}]
    with pytest.raises(CalibrationDataError, match="record 1 has no 'instruction' field"):
        load_recovery_texts(mixed)
    wrapped = tmp_path / "alpaca.json"
    wrapped.write_text(json.dumps({"data": [{"instruction": "say hi", "output": "hi"}]}))
    texts, kind = load_recovery_texts(str(wrapped))
    assert kind == "alpaca" and "### Instruction:\nsay hi" in texts[0]
