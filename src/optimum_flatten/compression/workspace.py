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
from typing import TYPE_CHECKING, Any

from ..calibration.precision import SPLIT_CHUNK_TOKENS, SPLIT_GRAM_BAND
from ..ops.ridge import ridge_leverage_scores

if TYPE_CHECKING:
    from ..adapters.moe import MoeShape

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
        """Largest temporaries of one block (of the given widths) on one batch. In a stack with sparse MLPs
        (``shape.moe``), at its own widths, the MLP's are the larger of a sparse layer's (`moe_forward`) and the
        widest dense layer's among them (``shape.dense_mlp_width``; none in Mixtral): the active width of a sparse
        layer, read as one dense MLP's, is neither."""
        s = self.shape
        moe = getattr(s, "moe", None) if mlp_width is None else None
        mlp_width = (s.dense_mlp_width if moe is not None else self.i) if mlp_width is None else mlp_width
        heads = s.num_heads if heads is None else heads
        kv_heads = s.num_kv_heads if kv_heads is None else kv_heads
        dense = moe is None or mlp_width > 0  # a sparse stack may have no dense layer (Mixtral)
        mlp = ((3 if s.gated_mlp else 2) * mlp_width + 2 * self.d) * self.Tb * self.b if dense else 0
        attention = ((2 * heads + 5 * kv_heads) * s.head_dim + self.d) * self.Tb * self.b
        return max(mlp, attention, 0 if moe is None else self.moe_forward(moe))

    def moe_forward(self, moe: MoeShape) -> int:
        """Largest temporaries of a sparse MLP block (`adapters.moe.MoeShape`) on one batch of T tokens, routed as
        transformers' default experts forward (``grouped_mm``, `transformers.integrations.moe`) routes them: every
        (token, expert) pair at once, S = top_k · T pairs: a dense MLP of the active width (3·k·i per token) came
        out 30% under a Mixtral layer's measured peak.

        Held through it: the residual and the normed input (2·T·d·b), the router logits (T·E·b), the routing
        weights (float32) and expert ids (int64) (12 per token and slot); the pairs sorted by expert: their ids
        and permutation (int64), gathered weights and histogram input (4 bytes each), 24·S, the per-expert counts
        and offsets (8·E), and each pair's token state gathered (S·d·b). Then the larger of: the gate step,
        ``act(gate) * up`` beside the fused gate/up product (2·i + i + i per pair), or the end, where the down
        projection's output, its product with the routing weights and that product put back in token order
        (float32 where the weights are: Mixtral's), and the inverse permutation, are alive together. A shared
        expert (Qwen2-MoE) runs first: its gated MLP (3·T·w_s·b), then its output (T·d·b) held beside the rest.
        Within 0.1% of the peak measured with a TorchDispatchMode on CPU, never under (tests/test_estimate_moe.py;
        Qwen's routing weights are in the model dtype, counted as float32 here). The eager
        experts loop holds one expert's tokens at a time, less; ``experts_implementation="batched_mm"``, which
        gathers every pair's expert weights (S·3·i·d·b), is not modelled."""
        k, e, i, d, b, tokens = moe.top_k, moe.num_experts, moe.expert_width, self.d, self.b, self.Tb
        pairs = k * tokens
        held = 2 * tokens * d * b + tokens * e * b + 12 * pairs + 24 * pairs + 8 * e + pairs * d * b
        gate = 4 * pairs * i * b
        end = pairs * d * b + 2 * pairs * d * max(b, 4) + 8 * pairs
        shared = tokens * d * b if moe.shared_width else 0
        return max(held + shared + max(gate, end), 2 * tokens * d * b + 3 * tokens * moe.shared_width * b)

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
