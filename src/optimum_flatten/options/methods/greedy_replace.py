"""greedy_replace's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/greedy_replace.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..hints import MethodConfig, check_scoring_batches
from .flattengpt import FlattenGPTConfig


@dataclass
class GreedyReplaceConfig(MethodConfig):
    """Options of the greedy drop-or-replace search.

    Attributes:
        scoring_batches: Score actions on the first this-many calibration batches (None: all); maps are always fitted
            on every batch. A step costs about L²/2 layer runs and 2L LM-head evaluations over the scored tokens.
        allow_drop: Consider plain drops besides replacements. False still drops the first layer kept (layer 0,
            or layer 1 once 0 is gone), which has no kept layer before it to be replaced from.
        shortlist: Score by NLL only the this-many actions whose state right after the action is closest (mean
            angle over the scored tokens) to the current model's state there; None scores every action. The
            pre-ranking needs no suffix run, so a step costs about one pass over the layers (the fits) plus
            `shortlist` suffix runs instead of L²/2 layer runs: on SmolLM2 the exhaustive search was still running
            after 40 CPU minutes.
        allow_flatten: Consider merging a pair of adjacent untouched layers as FlattenGPT does, besides drops and
            replacements (needs what FlattenGPT needs of the architecture). Each new pair costs FlattenGPT's
            per-group work (the wide block run twice up to its statistics, and the solves).
        flatten_options: `FlattenGPTConfig` fields for those merges (empty: FlattenGPT's defaults), so a search can
            be pinned to a FlattenGPT configuration whatever the defaults become; checked when the config is built.
            API only (not a command-line flag).
    """

    scoring_batches: int | None = 1
    allow_drop: bool = True
    shortlist: int | None = None
    allow_flatten: bool = False
    flatten_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_scoring_batches(self.scoring_batches)
        if self.shortlist is not None and (
            not isinstance(self.shortlist, int) or isinstance(self.shortlist, bool) or self.shortlist < 1
        ):
            raise ValueError(f"shortlist must be a positive integer or None, got {self.shortlist!r}.")
        if not isinstance(self.allow_flatten, bool):
            raise TypeError(f"allow_flatten must be True or False, got {self.allow_flatten!r}.")
        if not isinstance(self.flatten_options, dict):
            raise TypeError(f"flatten_options must be a dict of FlattenGPTConfig fields, got {self.flatten_options!r}.")
        self.flatten_config()  # refuses unknown or invalid options now, before any weight changes

    def flatten_config(self) -> FlattenGPTConfig:
        """The FlattenGPT configuration the merges use."""
        known = {f.name for f in fields(FlattenGPTConfig)}
        unknown = sorted(set(self.flatten_options) - known)
        if unknown:
            raise ValueError(f"flatten_options has no FlattenGPT option(s) {unknown}; known: {sorted(known)}.")
        return FlattenGPTConfig(**self.flatten_options)
