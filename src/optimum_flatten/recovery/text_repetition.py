"""How much a row of tokens repeats itself: the figure that tells a person the teacher's text loops.

A small model sampled at temperature 1 from a bare start token can fall into loops (the bundled Qwen2.5-Coder writes
"多多多多…"): such rows carry a few tokens' worth of text each. What a row repeats is measured as the share of its
n-grams that already stood earlier in the same row. Written English sits near zero: the pre-2000 State of the Union
speeches in rows of 256 tokens have a median of 0.4% repeated 4-grams, and 6 of about 8,600 rows exceed
`LOOPING_SHARE` (Qwen2.5's and SmolLM2's tokenizers alike; `benchmarks/recovery/teacher_text_makeup.py --speeches`),
so rows above it are counted as looping. The figure is reported, never used to select rows: which rows help healing
is measured in benchmarks/RESULTS.md, not assumed here. With ``RecoveryConfig.teacher_text_loops="mask"`` the same
mask takes the repeating tokens out of the loss (`mask_repeats`): every row is kept, and so is its context.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

#: n of the n-grams counted.
NGRAM = 4
#: Share of repeated n-grams above which a row counts as looping (about 1 speech row in 1,400 exceeds it).
LOOPING_SHARE = 0.25


def repeated_mask(ids: torch.Tensor, skip: int = 0, n: int = NGRAM) -> torch.Tensor:
    """A mask over ``ids[:, skip:]`` (rows × tokens): True at each token that ends an n-gram equal to one ending
    earlier in the same row, counted from token `skip` on (the token continues a repeat)."""
    rows = ids[:, skip:]
    mask = torch.zeros(rows.shape, dtype=torch.bool)
    for r, row in enumerate(rows.tolist()):
        seen: set[tuple[int, ...]] = set()
        for end in range(n - 1, len(row)):
            gram = tuple(row[end - n + 1 : end + 1])
            mask[r, end] = gram in seen
            seen.add(gram)
    return mask


def mask_repeats(rows: list[dict[str, torch.Tensor]], n: int = NGRAM) -> int:
    """Sets the label of every token of `rows` (training rows: ``input_ids``, ``labels``) that repeats an n-gram
    earlier in its row (`repeated_mask`) to -100, which the healing's losses skip (the prediction of that token is not
    trained; it stays in the input). Returns how many labels it masked."""
    masked = 0
    for row in rows:
        repeats = repeated_mask(row["input_ids"].unsqueeze(0), n=n)[0].to(row["labels"].device)
        masked += int((repeats & (row["labels"] != -100)).sum())
        row["labels"] = row["labels"].masked_fill(repeats, -100)
    return masked


def repeated_shares(ids: torch.Tensor, skip: int = 0, n: int = NGRAM) -> list[float]:
    """Per row of `ids` (rows × tokens), the share of its n-grams from token `skip` on (what the model wrote, not
    the start and prompt it was given) that equal an n-gram earlier in that row (`repeated_mask`); 0 for a row with
    fewer than n tokens after `skip`."""
    grams = ids.shape[1] - skip - n + 1
    if grams <= 0:
        return [0.0] * ids.shape[0]
    return [int(count) / grams for count in repeated_mask(ids, skip, n).sum(dim=1)]


def repetition_summary(ids: torch.Tensor, skip: int = 0, n: int = NGRAM) -> dict[str, Any]:
    """The rows' median share of repeated n-grams and how many rows loop (`repeated_shares`), for a record."""
    shares = repeated_shares(ids, skip, n)
    return {
        "ngram": n,
        "rows": len(shares),
        "median": round(statistics.median(shares), 4) if shares else 0.0,
        "looping_rows": sum(share > LOOPING_SHARE for share in shares),
        "looping_share": LOOPING_SHARE,
    }


def describe(summary: dict[str, Any], use: str = "a healing on it") -> str:
    """One line for a person: the median and the looping rows, with written text's figure beside them (and, where
    most rows loop, advice to read them before trusting `use`)."""
    line = (
        f"{summary['median']:.1%} of a row's {summary['ngram']}-grams repeat one before them (median; English "
        f"speeches: 0.4%); {summary['looping_rows']} of {summary['rows']} rows loop (over "
        f"{summary['looping_share']:.0%})"
    )
    if summary["rows"] and summary["looping_rows"] * 2 > summary["rows"]:
        line += f": most of this text is loops, read it before trusting {use}"
    return line
