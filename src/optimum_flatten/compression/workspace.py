"""The shared vocabulary of the workspace estimates (`optimum-flatten estimate`): named terms, phases and the sizes
of one (model, calibration) pair, in bytes.

Each method that has a memory model states it as `CompressionMethod.workspace`, next to the code whose allocations
it describes; `optimum_flatten.estimate` (the driver) builds the sizes from a model's shape and asks the method. The
symbols and the terms every method shares are documented there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..calibration.precision import SPLIT_CHUNK_TOKENS, SPLIT_GRAM_BAND
from ..ops.ridge import ridge_leverage_scores

#: Column panel of `ridge_leverage_scores` (its default), which sets the size of the solve's panel terms.
LEVERAGE_PANEL = int(inspect.signature(ridge_leverage_scores).parameters["block_size"].default)


@dataclass(frozen=True)
class Term:
    """One thing a phase holds: its name, its size in bytes, and why it is there."""

    name: str
    bytes: int
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": int(self.bytes), "why": self.why}


@dataclass(frozen=True)
class Phase:
    """The workspace of one phase at its peak: the sum of its terms (named as the method times it)."""

    name: str
    terms: tuple[Term, ...]

    @property
    def bytes(self) -> int:
        return int(sum(t.bytes for t in self.terms))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "workspace_bytes": self.bytes, "terms": [t.to_dict() for t in self.terms]}


#: Why the model would refuse a (method name, its config, corrections) request: "architecture" (its family cannot),
#: "request" (another refusal of the request), or None where it accepts. Built by the estimate from the model's
#: adapter with the refusals a compression runs first, so that a method composed of others (`auto`) models only the
#: ones that would run.
Refusal = Callable[[str, Any, Any], str | None]


class WorkspaceSizes:
    """The recurring sizes of one (model, calibration) pair, with the shared terms of the module docstring.

    `refusal` answers whether the model refuses a request (`Refusal`); without a model, every request is accepted.
    """

    def __init__(self, shape: Any, cal: Any, refusal: Refusal | None = None) -> None:
        self.shape, self.cal = shape, cal
        self.refusal: Refusal = refusal or (lambda _name, _config, _corrections: None)
        self.b = shape.dtype_bytes
        self.d, self.i = shape.hidden_size, shape.intermediate_size
        self.N, self.Tb = cal.tokens, cal.batch_tokens
        self.S = self.N * self.d * self.b
        self.S32 = self.N * self.d * 4

    def with_calibration(self, cal: Any) -> WorkspaceSizes:
        """The sizes of the same model on another calibration shape (a share of the batches)."""
        return WorkspaceSizes(self.shape, cal, self.refusal)

    def tokens(self) -> Term:
        return Term("calibration ids and masks", 2 * self.N * 8, "input_ids and attention_mask, int64")

    def runners(self, count: int, states: int | None = None) -> list[Term]:
        """`count` runners' call arguments and the layer-0 states of `states` of them (None: all; a runner whose
        walk released them holds none, `LayerwiseRunner.release_inputs`)."""
        arguments = self.cal.batches * (2 * self.cal.seqlen * self.shape.head_dim * self.b + 8 * self.cal.seqlen)
        which = "the runner" if count == 1 else f"{count} runners (the context keeps each one it opened)"
        held = count if states is None else states
        return [
            Term("layer-0 states of " + which, held * self.S, f"LayerwiseRunner.inputs, {held} of them held"),
            Term("call arguments of " + which, count * arguments, "rotary cos/sin and position ids per batch"),
        ]

    def run_outputs(self) -> int:
        """Outputs of the earlier batches while `LayerwiseRunner.run` runs the last one."""
        return self.S * (self.cal.batches - 1) // self.cal.batches

    def block_forward(self, mlp_width: int | None = None, heads: int | None = None, kv_heads: int | None = None) -> int:
        """Largest temporaries of one block (of the given widths) on one batch."""
        s = self.shape
        mlp_width = self.i if mlp_width is None else mlp_width
        heads = s.num_heads if heads is None else heads
        kv_heads = s.num_kv_heads if kv_heads is None else kv_heads
        mlp = ((3 if s.gated_mlp else 2) * mlp_width + 2 * self.d) * self.Tb * self.b
        attention = ((2 * heads + 5 * kv_heads) * s.head_dim + self.d) * self.Tb * self.b
        return max(mlp, attention)

    def run_term(self, what: str = "one layer", **widths: int) -> Term:
        return Term(
            f"running {what}: outputs so far + one batch's temporaries",
            self.run_outputs() + self.block_forward(**widths),
            "LayerwiseRunner.run collects every batch's output; the block's largest temporaries on one batch",
        )

    def moment_update(self, dim: int, split_bfloat16: bool = False) -> int:
        """`SecondMoment.update` on one batch: the float32 centred copy of its tokens, the dim² product (with
        `split_bfloat16`, per chunk of `SPLIT_CHUNK_TOKENS` its float32 centred copy, the stacked [hi; hi; lo; hi] and
        y − hi, 16 bytes a value, and one band's float32 product, 4·dim·`SPLIT_GRAM_BAND`). Packed calibration has
        no padding, so the tokens are read in place (`calibration.stats.real_rows`); with padding a masked copy of
        the batch's real tokens comes first (T_b·dim·b more)."""
        upcast = 4 if self.b != 4 else 0
        if split_bfloat16:
            chunk = min(SPLIT_CHUNK_TOKENS, self.Tb)
            return chunk * dim * (4 + 4 * 2 + 4) + 4 * dim * min(SPLIT_GRAM_BAND, dim)
        return max(self.Tb * dim * (upcast + 4), self.Tb * dim * 4 + 4 * dim * dim)


def per_batch_term(z: WorkspaceSizes, comparison: int, what: str) -> Term:
    return Term(
        f"largest per-batch work: a layer run, or the {what}",
        max(z.run_outputs() + z.block_forward(), comparison),
        "run outputs + block temporaries, or the comparison's float64 copies",
    )


#: What a memory model returns: the phases at their peaks, the stack passes, whether those are a bound, and notes.
WorkspaceModel = tuple[list[Phase], float, bool, list[str]]
