"""The shared vocabulary of the compute estimates (`optimum-flatten estimate`): per timed phase, the stack passes
it runs and the arithmetic the ops record in it (`utils.flops`), from the model's shape alone.

A method that states one (`CompressionMethod.compute`) gets a predicted time per phase from `estimate --device`;
one that does not gets its total stack passes turned into time (from its memory model) and no arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..utils import flops

#: Per phase: flops by kind and precision, the form of `utils.flops.ArithmeticCount.phases`.
Arithmetic = dict[str, dict[str, dict[str, float]]]


@dataclass
class ComputeModel:
    """What a compression computes, per phase: stack passes (weight × token products of layer runs, in passes of the
    calibration tokens through the original stack) and the method's own arithmetic. `notes` say what is a bound."""

    phase_passes: dict[str, float]
    arithmetic: Arithmetic
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"phase_passes": dict(self.phase_passes), "arithmetic": self.arithmetic, "notes": list(self.notes)}


class Tally:
    """The arithmetic of one phase, added the way the ops record it (`utils.flops.record`)."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, float]] = {}

    def add(self, value: float, precision: str, kind: str = "product") -> None:
        if value:
            by_precision = self.kinds.setdefault(kind, {})
            by_precision[precision] = by_precision.get(precision, 0.0) + float(value)

    def reads(self, count: float) -> None:
        self.add(count, "count", "host_reads")

    def launches(self, count: float) -> None:
        self.add(count, "count", "launches")

    def cholesky(self, n: int, precision: str = "float64") -> None:
        """`cholesky_shifted_in_place` succeeding at once behind `_shifted_cholesky` (or `_jittered_factor`): the
        factor, its status read and the jitter scale read."""
        self.add(flops.cholesky(n), precision, "factorisation")
        self.reads(2)

    def scaled(self, factor: float) -> dict[str, dict[str, float]]:
        return {kind: {p: v * factor for p, v in values.items()} for kind, values in self.kinds.items()}
