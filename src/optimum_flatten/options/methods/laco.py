"""LaCo's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/laco/).
"""

from __future__ import annotations

from dataclasses import dataclass

from .merge_search import MergeSearchConfig


@dataclass
class LaCoConfig(MergeSearchConfig):
    """Options of LaCo (the shared ones are documented on MergeSearchConfig).

    Attributes:
        window_size: Layers collapsed per merge (C in the paper); each accepted merge removes window_size - 1.
        interval: How far the window moves down after an accepted merge (I in the paper).
        threshold: Minimum cosine similarity to the original final hidden states (T in the paper, 0.65 there).
    """

    threshold: float | None = 0.65
    window_size: int = 4
    interval: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.window_size, int) or self.window_size < 2:
            raise ValueError(f"window_size must be an integer >= 2, got {self.window_size!r}.")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {self.interval!r}.")
