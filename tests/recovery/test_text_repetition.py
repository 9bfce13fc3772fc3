"""The teacher text's repetition figure against a naive count, and where a person reads it."""

from __future__ import annotations

import pytest
import torch

from optimum_flatten.recovery.text_repetition import (
    LOOPING_SHARE,
    describe,
    mask_repeats,
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


def test_masked_repeats_are_the_tokens_a_naive_count_finds_and_nothing_else():
    """`mask_repeats` sets to -100 the label of each token that ends an n-gram seen earlier in its row (counted
    naively, n-gram against every earlier one), keeps every other label and every input, leaves a label already -100
    as it was, and returns the labels it masked."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4, (5, 30), generator=generator)
    rows = [{"input_ids": row.clone(), "labels": row.clone()} for row in ids]
    rows[0]["labels"][:3] = -100  # a label masked before (a prompt's): stays, and is not counted again
    for n in (4, 2):
        copies = [{k: v.clone() for k, v in row.items()} for row in rows]
        masked = mask_repeats(copies, n=n)
        expected = 0
        for before, after in zip(rows, copies, strict=True):
            tokens = before["input_ids"].tolist()
            assert torch.equal(after["input_ids"], before["input_ids"])
            for end, token in enumerate(tokens):
                repeat = end >= n - 1 and any(
                    tokens[j - n + 1 : j + 1] == tokens[end - n + 1 : end + 1] for j in range(n - 1, end)
                )
                want = -100 if repeat or before["labels"][end] == -100 else token
                assert after["labels"][end] == want
                expected += repeat and before["labels"][end] != -100
        assert masked == expected > 0
