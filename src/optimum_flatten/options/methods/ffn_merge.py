"""ffn_merge's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/ffn_merge/method.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..hints import MethodConfig, check_scoring_batches

#: Original indices of the layers whose feed-forward sublayers are merged into one.
Window = tuple[int, ...]


# --------------------------------------------------------------------------------------------------- config
@dataclass
class FfnMergeConfig(MethodConfig):
    """Options of FFN merging. The target is the method's own: `num_windows` windows of `window_size` layers.

    Attributes:
        window_size: k, the number of adjacent feed-forward sublayers that end up sharing one set of parameters.
        num_windows: How many non-overlapping windows to merge (None: one, or ``len(window_starts)``).
        window_starts: 0-based first layers of the windows to merge (a list, or ``"1,4"``); None searches the best
            start positions.
        anchor: The layer of each window the others are aligned to: ``"first"``, ``"middle"`` (position
            ``(k - 1) // 2``) or ``"last"``.
        variant: ``"permute"`` aligns units before averaging (the paper's method); ``"vanilla"`` averages as is.
        alignment_signal: What is correlated to align units: ``"pre_activation"`` (the paper: output of the first
            linear map; for gated MLPs the mean of the gate and up correlations) or ``"hidden"`` (down's input).
        selection: How candidate windows are scored: ``"cosine"`` (mean token cosine of the final hidden states to
            the original model's, higher is better) or ``"nll"`` (calibration next-token NLL, lower is better).
        scoring_batches: Use only the first this-many calibration batches for alignment and scoring (None: all).
        tie: True makes the window's layers share the same tensors (the memory saving); False gives each layer
            its own copy of the averaged values (same function, no saving; e.g. to fine-tune them apart).
        sync_stacks: Merge the same window positions in every stack of the model in one compression (the paper's
            encoder + decoder setting for Marian), scored together (mean of the stacks' cosine scores). Leave
            FlattenConfig.stacks unset (or list every stack); needs ``selection="cosine"`` (an encoder has no LM
            head to score an NLL with). On a one-stack model it is the same as False.
        resume_candidates: With several windows, keep for every candidate below the best window of a round its
            state entering that window, so that the next round (which has it merged) resumes the candidate there
            instead of re-running the layers between. The same windows and scores; costs up to one more copy of
            the calibration states per stack. False keeps memory as before.
        score_at: Where a candidate window is scored: ``"output"`` (the final hidden states, the paper's selection:
            each candidate runs the rest of the stack, about L/2 stack passes a round) or ``"window"`` (the
            window's own output against the unmerged window's on the same input, mean masked token cosine: k layers
            a candidate, about k stack passes a round). ``"window"`` needs ``selection="cosine"``; the report's
            ``ffn_final_score`` is then still the final-state cosine of the chosen windows, measured once.
        shortlist: With ``score_at="window"``, rescore the this-many best windows of each round by the final states
            (the output criterion) and choose among them by that score: the cheap score shortlists, the paper's
            decides. None chooses by the window score alone.
        early_exit: Stop scoring a candidate window once it can no longer beat the best one (for "cosine" the
            tokens not scored yet are counted at cosine 1, for "nll" at loss 0): the same windows, the same final
            score, less work when candidates differ. Such a candidate's entry in ``ffn_window_scores`` has
            ``score: None`` and the ``bound`` it lost with, so it is off by default.
    """

    window_size: int = 2
    num_windows: int | None = None
    window_starts: list[int] | None = None
    anchor: Literal["first", "middle", "last"] = "first"
    variant: Literal["permute", "vanilla"] = "permute"
    alignment_signal: Literal["pre_activation", "hidden"] = "pre_activation"
    selection: Literal["cosine", "nll"] = "cosine"
    scoring_batches: int | None = None
    tie: bool = True
    sync_stacks: bool = False
    resume_candidates: bool = True
    early_exit: bool = False
    score_at: Literal["output", "window"] = "output"
    shortlist: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("window_size", self.window_size)
        if self.window_size < 2:
            raise ValueError(
                f"window_size must be at least 2 (one layer has nothing to share with), got {self.window_size}."
            )
        if self.num_windows is not None:
            _check_positive_int("num_windows", self.num_windows)
        check_scoring_batches(self.scoring_batches)
        _check_choice("anchor", self.anchor, ("first", "middle", "last"))
        _check_choice("variant", self.variant, ("permute", "vanilla"))
        _check_choice("alignment_signal", self.alignment_signal, ("pre_activation", "hidden"))
        _check_choice("selection", self.selection, ("cosine", "nll"))
        _check_choice("score_at", self.score_at, ("output", "window"))
        if self.shortlist is not None:
            _check_positive_int("shortlist", self.shortlist)
            if self.score_at != "window":
                raise ValueError(
                    f"shortlist={self.shortlist} rescores the windows a window-level score ranked best; it needs "
                    "score_at='window' (the output search already scores every window by the final states)."
                )
            if self.early_exit:
                raise ValueError(
                    "early_exit=True stops candidates that cannot beat the best window score, but a shortlist needs "
                    f"the {self.shortlist} best scores in full; use one of them."
                )
        if self.score_at == "window" and self.selection != "cosine":
            raise ValueError(
                f"score_at='window' compares the window's output states by cosine, got selection={self.selection!r}; "
                "a next-token loss needs the final states (score_at='output')."
            )
        if not isinstance(self.tie, bool):
            raise TypeError(f"tie must be True or False, got {self.tie!r}.")
        for name in ("sync_stacks", "resume_candidates", "early_exit"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.sync_stacks and self.selection != "cosine":
            raise ValueError(
                f"sync_stacks=True scores every stack by the cosine of its final states, got selection="
                f"{self.selection!r}; an encoder has no LM head for an NLL. Use selection='cosine'."
            )
        if self.window_starts is not None:
            self.window_starts = _check_window_starts(self.window_starts, self.window_size)
            if self.num_windows is not None and self.num_windows != len(self.window_starts):
                raise ValueError(
                    f"num_windows={self.num_windows} disagrees with the {len(self.window_starts)} window_starts "
                    f"{self.window_starts}; give one of them, or make them agree."
                )

    @property
    def resolved_num_windows(self) -> int:
        if self.window_starts is not None:
            return len(self.window_starts)
        return 1 if self.num_windows is None else self.num_windows

    def anchor_of(self, window: Window) -> int:
        """The original index of the anchor layer of `window`."""
        position = {"first": 0, "middle": (len(window) - 1) // 2, "last": len(window) - 1}[self.anchor]
        return window[position]


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")


def _check_window_starts(starts: Sequence[int] | str, window_size: int) -> list[int]:
    """Ascending, non-negative and non-overlapping start positions (the range is checked against the model later).

    A comma-separated string (``"1,4"``) is accepted too: it is what the generated ``--window-starts`` flag passes.
    """
    if isinstance(starts, str):
        try:
            starts = [int(part) for part in starts.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"window_starts must be comma-separated integers such as '1,4', got {starts!r}.") from None
    if isinstance(starts, bytes) or not isinstance(starts, Sequence) or not starts:
        raise ValueError(f"window_starts must be a non-empty list of layer indices or None, got {starts!r}.")
    for s in starts:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"window_starts must hold non-negative integers, got {list(starts)}.")
    ordered = sorted(starts)
    for a, b in itertools.pairwise(ordered):
        if b < a + window_size:
            raise ValueError(
                f"windows starting at {a} and {b} overlap (window_size={window_size} covers {a}..{a + window_size - 1}"
                f"); a layer can belong to one window only. Space the starts at least {window_size} apart."
            )
    return ordered
