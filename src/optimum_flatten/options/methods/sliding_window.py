"""Sliding-window merging's options: a torch-free declaration, read by `FlattenConfig`, the command line and the
method (methods/sliding_window.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .merge_search import MergeSearchConfig


@dataclass
class SlidingWindowConfig(MergeSearchConfig):
    """Options of Sliding-Window Merging (the shared ones are documented on MergeSearchConfig).

    Attributes:
        similarity: ``"cosine"`` (mean token cosine) or ``"cka"`` (linear CKA over tokens) of the final states.
    """

    similarity: Literal["cosine", "cka"] = "cosine"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.similarity not in ("cosine", "cka"):
            raise ValueError(f"similarity must be 'cosine' or 'cka', got {self.similarity!r}.")
