"""The teacher text's repetition figure against a naive count, and where a person reads it."""

from __future__ import annotations

import pytest
import torch

from optimum_flatten.recovery.text_repetition import (
    LOOPING_SHARE,
    describe,
    repeated_shares,
    repetition_summary,
)


def _naive_share(row: list[int], n: int) -> float:
    """Counts, n-gram by n-gram, those that equal one starting earlier in the row."""
    grams = [row[i : i + n] for i in range(len(row) - n + 1)]
    repeats = sum(any(grams[j] == grams[i] for j in range(i)) for i in range(len(grams)))
    return repeats / len(grams)


def test_shares_match_a_naive_count_and_skip_the_start_and_prompt():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (6, 40), generator=generator)  # a 5-token vocabulary repeats by chance
    for skip, n in ((0, 4), (7, 4), (3, 2)):
        expected = [_naive_share(row[skip:], n) for row in ids.tolist()]
        assert repeated_shares(ids, skip, n) == pytest.approx(expected, abs=1e-12)
    assert repeated_shares(ids, skip=38) == [0.0] * 6  # fewer than four tokens left


def test_a_loop_counts_as_looping_and_a_row_of_distinct_tokens_does_not():
    loop = torch.tensor([[1, 2, 3, 4, 5] + [9] * 35])  # 37 4-grams: 32 of [9,9,9,9], 31 repeats
    distinct = torch.arange(40).unsqueeze(0)
    assert repeated_shares(loop) == [pytest.approx(31 / 37)] and repeated_shares(distinct) == [0.0]
    summary = repetition_summary(torch.cat([loop, loop, distinct]))
    assert summary == {
        "ngram": 4, "rows": 3, "median": round(31 / 37, 4), "looping_rows": 2, "looping_share": LOOPING_SHARE,
    }  # fmt: skip
    assert repetition_summary(torch.cat([loop, distinct]))["median"] == round(15.5 / 37, 4)  # the middle two's mean


def test_the_line_warns_only_when_most_rows_loop():
    looping = {"ngram": 4, "rows": 4, "median": 0.47, "looping_rows": 3, "looping_share": 0.25}
    clean = {**looping, "median": 0.01, "looping_rows": 0}
    assert describe(looping).startswith("47.0% of a row's 4-grams repeat") and "3 of 4 rows loop" in describe(looping)
    assert "most of this text is loops" in describe(looping) and "most of this text" not in describe(clean)
