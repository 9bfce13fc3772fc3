"""Text -> token ids: one text, many texts in chunks, and one int64 stream of them all (packed calibration, the
evaluation corpora, plain healing text)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def tokenize_text(tokenizer: Any, text: str) -> list[int]:
    """One text's token ids, without special tokens (the calibration's and the streams' own, never a BOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


#: Texts a fast tokenizer encodes in one call (`tokenize_texts`): enough for its Rust pool to share them out, few enough
#: that one call's encodings (offsets and masks beside the ids) stay small whatever the corpus.
TOKENIZE_CHUNK_TEXTS = 64
#: Characters after which a chunk ends before `TOKENIZE_CHUNK_TEXTS`: a call's encodings and its lists of Python ints
#: grow with its tokens, not its texts. 64 State of the Union speeches (3.2M characters, 700K tokens) held 117 MiB
#: of resident memory while tokenising the bundled corpus; chunks of at most 2^20 characters about 50.
TOKENIZE_CHUNK_CHARS = 2**20


def tokenize_texts(tokenizer: Any, texts: Sequence[str]) -> Iterator[list[int]]:
    """Each text's token ids, without special tokens, in order. A fast tokenizer gets the texts in chunks of
    `TOKENIZE_CHUNK_TEXTS` (fewer where they reach `TOKENIZE_CHUNK_CHARS`), which its Rust pool encodes in parallel:
    the same ids as one call a text (a batch encodes each text alone), in about half the time on the bundled corpus on
    2 cores; any other tokenizer is called once a text, since only a fast one is known to take a list."""
    if not getattr(tokenizer, "is_fast", False):
        for text in texts:
            yield tokenize_text(tokenizer, text)
        return
    for chunk in _chunks(texts):
        yield from (list(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"])


def _chunks(texts: Sequence[str]) -> Iterator[list[str]]:
    """`texts` in order, cut into lists of at most `TOKENIZE_CHUNK_TEXTS` texts that end once they hold
    `TOKENIZE_CHUNK_CHARS` characters (a longer text is a chunk of its own)."""
    chunk: list[str] = []
    characters = 0
    for text in texts:
        chunk.append(text)
        characters += len(text)
        if len(chunk) >= TOKENIZE_CHUNK_TEXTS or characters >= TOKENIZE_CHUNK_CHARS:
            yield chunk
            chunk, characters = [], 0
    if chunk:
        yield chunk


def token_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """The texts' tokens in one 1-D int64 stream, each text followed by the EOS token when the tokenizer has one: the
    packing of calibration (`build_calibration_batches`), of the evaluation corpora (`evaluation.tokenize_corpus`) and
    of plain healing text (`recovery.data.build_training_rows`).

    Why a buffer of 8 bytes a token and not a list: a Python list of the ids holds an 8-byte pointer and, past 256, a
    32-byte int object a token, so the bundled 2.45M-token speech corpus took 150-220 MiB before its tensor was even
    made (a 45 MB jsonl: 567 MiB), none of it in `estimate`. Each chunk's ids (the tokenizer's own lists) are
    appended to an ``array('q')`` and dropped; the tensor is a view of that array, no copy."""
    eos = getattr(tokenizer, "eos_token_id", None)
    stream = array("q")
    for ids in tokenize_texts(tokenizer, texts):
        stream.extend(ids)
        if eos is not None:
            stream.append(int(eos))
    if not stream:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(stream, dtype=torch.long)  # keeps `stream` alive; nothing resizes it after this
