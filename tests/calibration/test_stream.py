"""The token stream that packing cuts into windows (`calibration.tokens.token_stream`): 8 bytes a token, and exactly the
ids, windows and batches that the list of Python ints it replaced gave."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

import tiny_models
from optimum_flatten import CalibrationConfig
from optimum_flatten.calibration import build_calibration_batches
from optimum_flatten.calibration import tokens as data_module
from optimum_flatten.evaluation import tokenize_corpus
from optimum_flatten.recovery.data import build_training_rows


class WideTokenizer:
    """Ids from 1000 up, as a real vocabulary's are: a Python int past 256 is an object of its own (28-32 bytes),
    which is what a list of the ids cost; the character tokenizer's small ids are shared and would hide it."""

    eos_token_id = 7
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [1000 + ord(c) for c in text]}


def _list_stream(tokenizer, texts: list[str]) -> list[int]:
    """The stream as it was built before: one call a text, every id a Python int in one list."""
    eos = tokenizer.eos_token_id
    return [i for text in texts for i in [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]]


def _list_batches(tokenizer, config: CalibrationConfig) -> list[torch.Tensor]:
    """The input_ids batches the list-based code drew: a seeded sample of windows (packing), or of padded texts."""
    rng = random.Random(config.seed)
    texts = list(config.dataset)
    if config.packing:
        stream = _list_stream(tokenizer, texts)
        windows = len(stream) // config.seqlen
        chosen = sorted(rng.sample(range(windows), config.nsamples))
        rows = [torch.tensor(stream[i * config.seqlen : (i + 1) * config.seqlen]) for i in chosen]
    else:
        rows = []
        for index in sorted(rng.sample(range(len(texts)), config.nsamples)):
            ids = tokenizer(texts[index], add_special_tokens=False)["input_ids"][: config.seqlen]
            row = torch.full((config.seqlen,), tokenizer.pad_token_id, dtype=torch.long)
            row[: len(ids)] = torch.tensor(ids)
            rows.append(row)
    return [torch.stack(rows[k : k + config.batch_size]) for k in range(0, len(rows), config.batch_size)]


@pytest.fixture(params=["fast", "char"])
def tokenizer(request, monkeypatch):
    """A fast tokenizer with chunks small enough that their seams fall inside the stream, and one called a text."""
    monkeypatch.setattr(data_module, "TOKENIZE_CHUNK_TEXTS", 3)
    monkeypatch.setattr(data_module, "TOKENIZE_CHUNK_CHARS", 400)  # and a chunk ends early on characters
    return tiny_models.tiny_hf_tokenizer() if request.param == "fast" else tiny_models.CharTokenizer()


@pytest.mark.parametrize("packing", [True, False])
def test_the_batches_are_those_a_list_of_the_ids_gave(tokenizer, packing):
    texts = tiny_models.sample_texts(num=30, seed=5)
    config = CalibrationConfig(dataset=texts, nsamples=10, seqlen=48, batch_size=4, seed=3, packing=packing)
    batches = build_calibration_batches(tokenizer, config)
    expected = _list_batches(tokenizer, config)
    assert len(batches) == len(expected) == 3
    for batch, reference in zip(batches, expected, strict=True):
        assert batch.input_ids.dtype == torch.long and torch.equal(batch.input_ids, reference)


def test_the_evaluation_and_healing_streams_are_those_a_list_of_the_ids_gave(tokenizer):
    texts = tiny_models.sample_texts(num=30, seed=6)
    expected = _list_stream(tokenizer, texts)
    corpus = tokenize_corpus(tokenizer, texts)
    assert corpus.dtype == torch.long and corpus.tolist() == expected
    rows = build_training_rows(tokenizer, texts, "text", seqlen=40, max_samples=None, seed=0)
    assert [row["input_ids"].tolist() for row in rows] == [
        expected[k : k + 40] for k in range(0, len(expected) - 40 + 1, 40)
    ]
    assert all(torch.equal(row["labels"], row["input_ids"]) for row in rows)
    rows[0]["input_ids"][0] = -1  # a row owns its storage: the next one, and the stream's reader, see nothing
    assert rows[1]["input_ids"].tolist() == expected[40:80]
    assert tokenize_corpus(tokenizer, []).shape == (0,)


def test_the_stream_holds_8_bytes_a_token_not_a_python_int():
    """What Python allocates while the stream is built, at its peak, per token: a list of the ids took 8 bytes of
    slot and 32 of int object a token (40); the int64 buffer takes 8 (9 with its growth), and one text's ids at a
    time."""
    texts = [" ".join(["state of the union"] * 50)] * 200  # 190,000 tokens
    tokenizer = WideTokenizer()
    tracemalloc.start()
    try:
        stream = data_module.token_stream(tokenizer, texts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(stream, torch.Tensor) and stream.dtype == torch.long
    assert stream.tolist() == _list_stream(tokenizer, texts)
    assert peak / len(stream) < 12, f"{peak / len(stream):.1f} bytes a token"
