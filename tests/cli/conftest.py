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
