"""What the command-line tests start from."""

from __future__ import annotations

import pytest

import tiny_models


@pytest.fixture
def llama_on_disk(tmp_path):
    """(a tiny LLaMA with a real tokenizer, a text of 60 documents), written to disk as a user's checkpoint would be."""
    path = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(path)
    tiny_models.tiny_hf_tokenizer().save_pretrained(path)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(60)))
    return path, text


@pytest.fixture
def pair(tmp_path):
    """(dense, compressed, text) on disk: a tiny LLaMA as a user's dense checkpoint, the same model compressed by
    FlattenGPT and written by `FlattenQuantizer.save`, and a text of 60 documents: what `recover --teacher` reads."""
    from common import dense_and_compressed_on_disk

    dense, compressed = dense_and_compressed_on_disk(tmp_path, tiny_models.tiny_hf_tokenizer())
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(60)))
    return dense, compressed, text
