"""Seeded choices among a healing's rows and prompts: which rows a mix keeps, which rows or prompts the gate holds out.

Each caller passes its own seed offset, so that the choices of one healing are reproducible and independent of one
another (the held-out rows are not the rows a mix drops)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

Item = TypeVar("Item")


def seeded_subset(items: Sequence[Item], count: int, seed: int) -> list[Item]:
    """`count` of `items`, a seeded choice kept in order (all of them when there are no more)."""
    if count >= len(items):
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), count))]


def seeded_split(items: Sequence[Item], count: int, seed: int) -> tuple[list[Item], list[Item]]:
    """(the rest, `count` chosen with the seed), both in order and disjoint; `count` must not exceed `len(items)`."""
    chosen = set(random.Random(seed).sample(range(len(items)), count))
    return [x for i, x in enumerate(items) if i not in chosen], [x for i, x in enumerate(items) if i in chosen]
