"""SLEB's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/sleb.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hints import MethodConfig, check_scoring_batches


@dataclass
class SLEBConfig(MethodConfig):
    """Options of SLEB.

    Attributes:
        protect_first: Never remove the first layer.
        protect_last: Never remove the last layer.
        scoring_batches: Score removals on the first this-many calibration batches only (None: all); the cost of
            a step is at most about L²/2 layer runs plus L LM-head evaluations over the scored tokens.
        resume_candidates: Keep, for every candidate below the current best removal, its state entering that
            layer, so that the next step resumes the candidate there instead of re-running the layers between
            (the same numbers; it saves layer runs on every step but the first). Costs up to one more copy of the
            states on the scored batches; False keeps memory as low as the exhaustive search's.
    """

    protect_first: bool = False
    protect_last: bool = False
    scoring_batches: int | None = None
    resume_candidates: bool = True

    def __post_init__(self) -> None:
        check_scoring_batches(self.scoring_batches)
        if not isinstance(self.resume_candidates, bool):
            raise TypeError(f"resume_candidates must be True or False, got {self.resume_candidates!r}.")
