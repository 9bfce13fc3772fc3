"""Will it fit? The memory and compute a compression will need, from the model's shape alone (no weights, no text).

`estimate_checkpoint` reads a checkpoint's config.json, builds the model on the meta device (shapes, no storage) and
returns, for one method and one calibration size, the bytes every phase of the compression holds at its peak:

- **weights resident**: every parameter and buffer of the model once (tied tensors once), in the load dtype;
- **workspace**: everything the compression allocates on top of them, phase by phase, written as named terms
  (calibration states, statistics, factors, block copies, the largest per-batch temporaries);

and the cost in **stack passes**, the unit `FlattenQuantizer.report["cost"]` uses (weight x token products over one
pass of the calibration tokens through the original stack). The phases carry the names the methods time
(`report["timings_seconds"]`), so an estimate can be read against a run.

Every term follows what the code of the method holds alive (read from `methods/` and `calibration/`), and
`tests/test_estimate.py` checks the estimate, phase by phase, against the peak of the tensors a real compression
allocates on a small LLaMA. Symbols used below, all in bytes or element counts:

    N = nsamples · seqlen calibration tokens; T_b = batch_size · seqlen tokens in one calibration batch;
    d hidden size, i MLP width, H / KV query / key-value heads of size d_h, V vocabulary, L layers, n removed;
    b bytes of the model dtype; S = N·d·b one copy of the calibration states (the residual stream at one layer
    boundary, kept in the model dtype); S32 = N·d·4.

Terms every method shares:

- *runner*: `LayerwiseRunner` keeps the states entering layer 0 (S) and the call arguments of every batch
  (rotary cos/sin, 2·seqlen·d_h·b, and position ids, 8·seqlen, per batch, shared by the layers). The method context
  keeps every runner it created until the compression ends (`MethodContext._runners`, read for the cost), so a
  method that opens a second runner pays S twice.
- *run*: `LayerwiseRunner.run` collects the outputs of all batches in a list, so while it runs the last batch it
  holds (batches − 1)/batches · S of outputs besides its input.
- *block forward*: one decoder layer on one batch holds, at its largest, the gated MLP's act(gate), up and their
  product (3·T_b·i·b) beside the residual and the normed input (2·T_b·d·b); attention holds q, k, v and the rotary
  temporaries (T_b·d_h·b·(2·H + 5·KV) + T_b·d·b). Fused attention (SDPA) is assumed: no T_b·seqlen score matrix.

The per-method terms are documented on each `_<method>` function. Limits: a uniform stack (every layer the shape of
layer 0), packing (no padding), the whole model in one memory (with offloaded layers the weights resident drop to
what the device_map keeps, the workspace does not), and the LLaMA layout of a block (other families are estimated
with the same formulas; their per-batch temporaries may differ).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adapters import get_adapter
from .adapters.base import ArchitectureAdapter
from .methods.pipeline import Corrections, preflight
from .methods.registry import get_method_class, require_capabilities
from .ops.ridge import max_refined, ridge_leverage_scores
from .utils.loading import model_class_for, one_line, resolve_model_source

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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


@dataclass(frozen=True)
class ModelShape:
    """The sizes an estimate needs, read from a model (on the meta device or not).

    Attributes:
        layer_weights, attention_weights, mlp_weights, head_weights: parameter counts of one layer, of its
            attention (q, k, v, o), of its MLP, and of the LM head (0 without one).
        o_weights, down_weights: parameters of one layer's output and down projections (a run that stops at their
            input skips them).
        weights_bytes: every parameter and buffer of the model once, at its own dtype.
        dtype_bytes: bytes of one element of the model's floating-point weights (and of its states).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool
    dtype: str
    dtype_bytes: int
    weights_bytes: int
    layer_weights: int
    attention_weights: int
    mlp_weights: int
    head_weights: int
    o_weights: int = 0
    down_weights: int = 0

    @property
    def norm_weights(self) -> int:
        """Parameters of one layer outside attention and MLP (its norms): a wide block keeps one set."""
        return self.layer_weights - self.attention_weights - self.mlp_weights

    @property
    def layer_bytes(self) -> int:
        return self.layer_weights * self.dtype_bytes

    @classmethod
    def of(cls, model: nn.Module, stack: str | None = None) -> ModelShape:
        """Reads the shape of `model` through its architecture adapter (so every supported family works)."""
        adapter = get_adapter(model)
        stack = stack or _single_stack(adapter)
        block = adapter.block(stack, 0)
        attention, mlp = block.attention, block.mlp
        head = adapter.lm_head(stack)
        floating = [p for p in model.parameters() if p.is_floating_point()]
        return cls(
            architecture=type(model).__name__,
            num_layers=adapter.num_layers(stack),
            hidden_size=attention.geometry.hidden_size,
            intermediate_size=mlp.intermediate_size,
            num_heads=attention.geometry.num_heads,
            num_kv_heads=attention.geometry.num_kv_heads,
            head_dim=attention.geometry.head_dim,
            vocab_size=0 if head is None else int(next(head.parameters()).shape[0]),
            gated_mlp=mlp.gate is not None,
            dtype=str(floating[0].dtype).removeprefix("torch.") if floating else "float32",
            dtype_bytes=floating[0].element_size() if floating else 4,
            weights_bytes=_unique_bytes(model),
            layer_weights=_count(block.module),
            attention_weights=sum(_count_view(v) for v in (attention.q, attention.k, attention.v, attention.o)),
            mlp_weights=sum(_count_view(v) for v in (mlp.up, mlp.gate, mlp.down) if v is not None),
            head_weights=0 if head is None else _count(head),
            o_weights=_count_view(attention.o),
            down_weights=_count_view(mlp.down),
        )

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class CalibrationShape:
    """The calibration size: `nsamples` sequences of `seqlen` tokens, run `batch_size` sequences at a time."""

    nsamples: int
    seqlen: int
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    @property
    def tokens(self) -> int:
        return self.nsamples * self.seqlen

    @property
    def batches(self) -> int:
        return math.ceil(self.nsamples / self.batch_size)

    @property
    def batch_tokens(self) -> int:
        return min(self.batch_size, self.nsamples) * self.seqlen


@dataclass
class MemoryEstimate:
    """What a compression will hold and cost. `peak_bytes` = weights + the largest phase's workspace."""

    method: str
    num_layers_to_remove: int
    model: ModelShape
    calibration: CalibrationShape
    phases: list[Phase]
    stack_passes: float
    stack_passes_is_bound: bool = False
    notes: list[str] = field(default_factory=list)
    source: str | None = None

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def workspace_bytes(self) -> int:
        return self.peak_phase.bytes

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.workspace_bytes

    def phase(self, name: str) -> Phase:
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"no phase {name!r}; phases: {[p.name for p in self.phases]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "method": self.method,
            "num_layers_to_remove": self.num_layers_to_remove,
            "model": self.model.to_dict(),
            "calibration": {
                "nsamples": self.calibration.nsamples,
                "seqlen": self.calibration.seqlen,
                "batch_size": self.calibration.batch_size,
                "tokens": self.calibration.tokens,
            },
            "weights_bytes": self.weights_bytes,
            "workspace_bytes": {
                "peak": self.workspace_bytes,
                "peak_phase": self.peak_phase.name,
                "phases": {p.name: p.bytes for p in self.phases},
            },
            "peak_bytes": self.peak_bytes,
            "stack_passes": self.stack_passes,
            "stack_passes_is_bound": self.stack_passes_is_bound,
            "phases": [p.to_dict() for p in self.phases],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        """A table of the phases, the peak with its largest terms, and the stack passes (what the CLI prints)."""
        shape, cal = self.model, self.calibration
        lines = [
            f"{self.method}: {shape.architecture}, {shape.num_layers} layers (hidden {shape.hidden_size}, MLP "
            f"{shape.intermediate_size}, {shape.num_heads} heads / {shape.num_kv_heads} KV), "
            f"{shape.dtype}; removing {self.num_layers_to_remove} layers; calibration "
            f"{cal.nsamples} x {cal.seqlen} tokens in batches of {cal.batch_size}",
            "",
        ]
        rows = [(p.name, _gib(p.bytes), _gib(p.bytes + self.weights_bytes)) for p in self.phases]
        header = ("phase", "workspace", "with weights")
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(3)]
        for k, row in enumerate([header, *rows]):
            cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))]
            lines.append("  ".join(cells))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        peak = self.peak_phase
        largest = sorted(peak.terms, key=lambda t: -t.bytes)[:4]
        lines += [
            "",
            f"weights resident: {_gib(self.weights_bytes)}",
            f"peak workspace:   {_gib(self.workspace_bytes)} in {peak.name} (largest: "
            + "; ".join(f"{t.name} {_gib(t.bytes)}" for t in largest)
            + ")",
            f"peak:             {_gib(self.peak_bytes)} ({self.peak_bytes:,} bytes)",
            f"stack passes:     {'at most ' if self.stack_passes_is_bound else ''}{self.stack_passes:.3f} (one pass: "
            f"{cal.tokens:,} tokens through the {shape.num_layers}-layer stack)",
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- shared terms
class _Sizes:
    """The recurring sizes of one (model, calibration) pair, with the shared terms of the module docstring."""

    def __init__(self, shape: ModelShape, cal: CalibrationShape) -> None:
        self.shape, self.cal = shape, cal
        self.b = shape.dtype_bytes
        self.d, self.i = shape.hidden_size, shape.intermediate_size
        self.N, self.Tb = cal.tokens, cal.batch_tokens
        self.S = self.N * self.d * self.b
        self.S32 = self.N * self.d * 4

    def tokens(self) -> Term:
        return Term("calibration ids and masks", 2 * self.N * 8, "input_ids and attention_mask, int64")

    def runners(self, count: int) -> list[Term]:
        arguments = self.cal.batches * (2 * self.cal.seqlen * self.shape.head_dim * self.b + 8 * self.cal.seqlen)
        which = "the runner" if count == 1 else f"{count} runners (the context keeps each one it opened)"
        return [
            Term("layer-0 states of " + which, count * self.S, "LayerwiseRunner.inputs, one copy each"),
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

    def moment_update(self, dim: int) -> int:
        """`SecondMoment.update` on one batch: the masked token copy, its float32 centred copy, the dim² product."""
        upcast = 4 if self.b != 4 else 0
        return max(self.Tb * dim * (self.b + upcast + 4), self.Tb * dim * (self.b + 4) + 4 * dim * dim)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _count_view(view: Any) -> int:
    return view.weight.numel() + (0 if view.bias is None else view.bias.numel())


def _unique_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def _single_stack(adapter: ArchitectureAdapter) -> str:
    stacks = adapter.stacks()
    if len(stacks) != 1:
        raise ValueError(
            f"this {type(adapter.model).__name__} has the stacks {stacks}; say which one the estimate is for "
            "(stack=...), as the compression compresses one at a time."
        )
    return stacks[0]


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


# ------------------------------------------------------------------------------------------------------ methods
def _flattengpt(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """FlattenGPT: a similarity pass, then per merged group a wide block, two statistics and their solves.

    The application reuses the selection's runner (one S), and each compressed block takes its first member's place
    as soon as it is built (and, without the cache below, propagated): no block is held beside the one it replaces.

    - selection: the runner (S) and the states entering and leaving the layer being run (S + run outputs), plus
      `band` float32 unit-normalised copies of the states (the similarity window; the automatic band is the whole
      stack when L copies fit `similarity_memory_gb`, else max_group_size − 1), and, when the last layer is
      normalised, the copies of its earlier batches and one batch's float64 temporaries (20·T_b·d). With the whole
      stack in the band, the float64 token norms of every layer (8·N each) are kept too.
    - the **cache**: with the whole stack in the band and `calibration_mode="one_pass"`, the unit copies and norms of
      the layers that start a merged group stay after the plan (n of them, fewer as groups are done), and each
      group's input is rebuilt from them (S): the application runs no layer of the original model again.
      Otherwise the states entering the group (S) come from propagating the original layers.
    - flatten: the states entering the group, the group's member copies (g layers) and the wide block (g layers),
      which starts as a copy of the first member whose weights are replaced one by one (its down projection, d·i,
      is the last to go).
    - head_scoring: the wide block (g layers); the o_proj input second moment (float64, (g·H·d_h)²); the wide block
      runs each batch only up to its o_proj input, where it holds q, k, v and the attention output while the head
      scores take two float64 copies of that input (16·T_b·g·H·d_h) and the moment its own update.
    - covariance (the o_proj moment is freed before it; the wide block has its pruned attention): the MLP statistic
      C — `covariance_dtype="float32"`: a float32 scatter 4·(g·i)², each batch adding, in chunks of 4096 tokens, a
      centred float32 copy straight into it; "float64": 8·(g·i)² and one float32 (g·i)² product per batch — and the
      block's MLP activations up to the down projection (which does not run): act(gate), up and their product
      while it is computed, then the product with the update's masked token copy and centred chunk.
    - solve, float32 (w = g·i channels, k = i kept, r = w − k dropped, B = 1024-channel panels), the largest of:
      (a) the leverage scores: the scatter, the factor's lower-triangular panels in float32 (4·(w² + w·B)/2), one
      panel read from C in float64 and cast (12·w·B; one panel of L⁻¹ and its square are less), or the float64
      re-scoring of the m channels nearest the cut (4 float64 w × m blocks and a float64 panel of C, m =
      `max_refined(w)` at most: a bound); (b) reading the kept blocks: the scatter, C[K, K] and C[K, R] W_D[R]
      in float64 (8·k² + 8·k·d) and one chunk's copies ((4·w + 12·k)·B + 8·B·d); (c) after the scatter is dropped:
      C[K, K], its float64 Cholesky factor (8·k² each), C[K, R] W_D[R], the float64 kept rows, the solve and their
      sum (4 · 8·k·d). float64: C, its full factor and three (w × B) float64 panels, or the Nyström correction
      (the k × k factor and the k × r block of C, float64 copies of W_down), whichever is larger.
    - propagate (without the cache): the states entering and leaving the layer, and the group's compressed block
      until it replaces its first member.

    g is max_group_size (with None, the worst case n + 1); n groups at most (exactly n with pairs).
    Cost: the selection runs L − 1 layers; without the cache the application runs every layer once more (the
    members of a group too, on the original model's states); per group the wide block runs twice, each time only up
    to the statistic: all heads up to o_proj, then the pruned attention and the MLP up to the down projection.
    """
    s, b, d, i = z.shape, z.b, z.d, z.i
    L = s.num_layers
    g = min(config.max_group_size or n + 1, n + 1, L)
    band = config.similarity_band or _auto_band(z, config, L)
    cached = band >= L and config.calibration_mode == "one_pass"
    width = g * i  # the wide MLP: the statistic C is width x width
    heads_width = g * s.num_heads * s.head_dim
    keep, rest = i, width - i
    float64 = config.covariance_dtype == "float64"
    needs_o = config.attention_correction or config.head_selection == "reconstruction"
    norm_bytes = s.norm_weights * b
    wide = Term(
        "wide block", g * (s.attention_weights + s.mlp_weights) * b + norm_bytes, f"the {g} members side by side"
    )
    pruned = Term(
        "wide block with its pruned attention",
        (s.attention_weights + g * s.mlp_weights) * b + norm_bytes,
        "the kept heads and the g members' MLP channels",
    )
    o_moment = Term(
        "o_proj input second moment (float64)",
        8 * heads_width * heads_width if needs_o else 0,
        "(g·H·d_h)², for the attention refit; freed before the MLP statistics",
    )
    c_bytes = (8 if float64 else 4) * width * width
    c_moment = Term(
        f"MLP second moment C ({config.covariance_dtype})",
        c_bytes,
        "(g·i)², the ridge statistics" + ("" if float64 else ": a centred scatter, the mean part kept in float64"),
    )
    cache = Term(
        "cached inputs of the merged groups' first layers",
        (n - 1) * (z.S32 + 8 * z.N) if cached else 0,
        "unit copies and float64 norms from the selection, one fewer per group done",
    )
    apply_base = [
        z.tokens(),
        *z.runners(1),
        cache,
        Term("states entering the group", z.S, "rebuilt from the cache" if cached else "the propagated stream"),
    ]
    copies = min(band, L - 1)
    normalise = z.S32 * (z.cal.batches - 1) // z.cal.batches + 20 * z.Tb * d
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("states entering the layer", z.S, "one boundary of the stack"),
            Term(f"float32 unit copies in the similarity band ({copies})", copies * z.S32, f"band = {band}"),
            Term("float64 token norms of every layer", L * 8 * z.N if band >= L else 0, "the cache's norms"),
            Term(
                "largest per-batch work: a layer run, or normalising the last layer",
                max(z.run_outputs() + z.block_forward(), normalise),
                "run outputs + block temporaries, or one more float32 copy + float64 temporaries",
            ),
        ),
    )
    flatten = Phase(
        "flatten",
        (
            *apply_base,
            Term(
                "member copies and the wide block, with the last weight of the copy it starts from",
                2 * g * s.layer_bytes + d * i * b,
                "the wide block starts as a copy of the first member whose weights are replaced one by one",
            ),
        ),
    )
    at_o_hook = (d + 2 * heads_width + 2 * g * s.num_kv_heads * s.head_dim) * z.Tb * b
    head_hook = max(16 * z.Tb * heads_width, z.moment_update(heads_width) if needs_o else 0)
    head_scoring = Phase(
        "head_scoring",
        (
            *apply_base,
            wide,
            o_moment,
            Term(
                "one batch of the wide block, stopped at the o_proj input",
                at_o_hook + head_hook,
                "q, k, v, attention output; float64 head scores; the moment's token copies and product",
            ),
        ),
    )
    chunk = min(4096, z.Tb)
    upcast = 4 if b != 4 else 0
    update = z.moment_update(width) if float64 else z.Tb * width * b + chunk * width * (4 + upcast)
    # The MLP peaks at act(gate), up and their product; at the hook only the product (the down input) is left.
    mlp_forward = ((3 if s.gated_mlp else 2) * width + 2 * d) * z.Tb * b
    at_down_hook = max(mlp_forward, (width + 2 * d) * z.Tb * b + update)
    attention_temporaries = z.block_forward(1, s.num_heads, s.num_kv_heads)
    covariance = Phase(
        "covariance",
        (
            *apply_base,
            pruned,
            c_moment,
            Term(
                "one batch of the wide block, stopped at the down-projection input",
                max(at_down_hook, attention_temporaries),
                "the MLP activations, the masked token copy and the centred float32 chunk"
                + (" and the float32 (g·i)² product" if float64 else ""),
            ),
        ),
    )
    block = min(width, LEVERAGE_PANEL)
    if float64:
        leverage = 8 * width * width + 3 * 8 * width * block
        nystrom = 8 * (width * d + 2 * keep * d + keep * keep + keep * rest + rest * d)
        solve_term = Term(
            "leverage scores: Cholesky factor of C + three column panels"
            if leverage >= nystrom
            else "Nyström correction: kept-block factor, C[K, R] and float64 copies of W_down",
            max(leverage, nystrom),
            "float64; the factor is the size of C",
        )
        solve_terms = (c_moment, solve_term)
    else:
        # The triangle and one panel of L⁻¹ with its square; or, after them, the float64 re-scoring of the channels
        # near the cut (unit vectors, solution, residual and a solve's copy, m columns each) with one panel of C.
        refine = 4 * 8 * width * max_refined(width) + 8 * width * block
        # While a panel is factorised it is also read from C in float64 and cast (12·w·B).
        leverage = 2 * (width * width + width * block) + max(12 * width * block, refine)
        reading = 8 * keep * keep + 8 * keep * d + (4 * width + 12 * keep) * block + 8 * block * d
        kept_solve = 16 * keep * keep + 4 * 8 * keep * d
        with_scatter = max(leverage, reading)
        if c_bytes + with_scatter >= kept_solve:
            solve_terms = (
                c_moment,
                Term(
                    "leverage scores: float32 factor as a triangle + one panel of L⁻¹"
                    if leverage >= reading
                    else "kept blocks: C[K, K] and C[K, R] W_D[R] in float64",
                    with_scatter,
                    "beside the float32 scatter",
                ),
            )
        else:
            solve_terms = (
                Term(
                    "Nyström solve: C[K, K] and its float64 factor, C[K, R] W_D[R], the kept rows and the result",
                    kept_solve,
                    "after the scatter is dropped",
                ),
            )
    solve = Phase("solve", (*apply_base, pruned, *solve_terms))
    phases = [selection, flatten, head_scoring, covariance, solve]
    if not cached:
        propagate = Phase(
            "propagate",
            (
                *apply_base,
                Term("the group's compressed block", s.layer_bytes, "until it replaces its first member"),
                z.run_term(),
            ),
        )
        phases.append(propagate)
    p_layer, p_att, p_mlp, p_norm = s.layer_weights, s.attention_weights, s.mlp_weights, s.norm_weights
    groups = n if g == 2 else math.ceil(n / (g - 1))
    # Up to o_proj (all heads, the attention norm: half the norms), then up to the down projection (pruned heads).
    per_group = g * (p_att - s.o_weights) + p_norm / 2 + p_att + p_norm + g * (p_mlp - s.down_weights)
    if cached:
        propagation = 0
    elif config.calibration_mode == "sequential":
        # The compressed block (one layer) runs instead of its g members.
        propagation = L * p_layer - groups * (g - 1) * p_layer
    else:
        propagation = L * p_layer
    passes = ((L - 1) * p_layer + propagation + groups * per_group) / (L * p_layer)
    notes = []
    if g != 2:
        notes.append(f"groups of up to {g} layers assumed (max_group_size={config.max_group_size}): a bound")
    return phases, passes, g != 2, notes


def _auto_band(z: _Sizes, config: Any, num_layers: int) -> int:
    """`FlattenGPTMethod._auto_band`: every layer when L float32 copies fit the budget, else the narrowest band."""
    fits = max(1, int(config.similarity_memory_gb * 2**30 // max(z.S32, 1)))
    if fits >= num_layers:
        return num_layers
    return fits if config.max_group_size is None else config.max_group_size - 1


def _shortgpt(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """ShortGPT: one walk over the stack, Block Influence = 1 − cos(input, output) per layer.

    - selection: the runner (S); the walk's previous boundary, which the caller's loop variable still holds, and its
      current one (2S); the boundary being computed (run); or, between runs, the float64 cosine of one batch
      (`cosine_rows` over every token: two float64 copies, their masked copies and a product, 40·T_b·d).
    """
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("the walk's two boundaries", 2 * z.S, "the input and output of the last layer run"),
            _per_batch(z, 40 * z.Tb * z.d, "float64 cosine over every token"),
        ),
    )
    return [selection], 1.0, False, []


def _per_batch(z: _Sizes, comparison: int, what: str) -> Term:
    return Term(
        f"largest per-batch work: a layer run, or the {what}",
        max(z.run_outputs() + z.block_forward(), comparison),
        "run outputs + block temporaries, or the comparison's float64 copies",
    )


def _sleb(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """SLEB: the states entering every kept layer, and each candidate's suffix run batch by batch from them.

    - selection: the runner (S, all batches) and the L states the search keeps on the scored batches (fraction f of
      S each: `scoring_batches`), the input of the layer a candidate's suffix runs and its outputs so far (one more
      copy and the run's), and the block temporaries or the next-token loss of one row
      (`next_token_nll`: the LM head's logits in float32, their valid rows and the log-softmax, 12·seqlen·V; a
      16-bit head output is freed once cast). With more than one step and `resume_candidates`, the candidates
      below the best removal keep their state entering it for the next step: up to L − 2 more states.
    Cost, a bound: at most what the exhaustive search spends, each step with L′ kept layers running L′ layers for
    the states, L′(L′ − 1)/2 for the suffixes and L′ LM heads. The search spends less: candidates stop once they
    lose, the states below a removal are kept, and candidates resume from their stored states.
    """
    s, L = z.shape, z.shape.num_layers
    scored = min(config.scoring_batches or z.cal.batches, z.cal.batches)
    fraction = min(1.0, scored * z.cal.batch_size / z.cal.nsamples)
    scored_states = int(z.S * fraction)
    nll = 12 * z.cal.seqlen * s.vocab_size
    forward = z.block_forward()
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term(
                f"states entering every layer on the scored batches ({L})", L * scored_states, f"fraction {fraction:g}"
            ),
            Term("a candidate's suffix: the input of the layer run", scored_states, "the output of the layer before"),
            Term(
                "candidates' states entering the best removal, for the next step",
                (L - 2) * scored_states if n > 1 and getattr(config, "resume_candidates", False) else 0,
                "at most one per candidate below it (resume_candidates)",
            ),
            Term(
                "largest per-batch work: a layer run, or one row's next-token loss",
                max(int(z.run_outputs() * fraction) + forward, nll),
                "run outputs + block temporaries, or logits (seqlen × V) with their float32 copies",
            ),
        ),
    )
    steps = range(L, L - n, -1)
    work = sum(k + k * (k - 1) / 2 + k * s.head_weights / s.layer_weights for k in steps)
    return [selection], fraction * work / L, True, []


def _uidl(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """UIDL: one walk keeping the last size + 1 boundaries, for the angular distance of every block of size n/blocks.

    - selection: the runner's layer-0 states (once they leave the window), the window of size + 1 boundaries, the
      boundary being computed (run), or the float64 last-token cosine of one batch (two float64 copies, 16·T_b·d).
    """
    L = z.shape.num_layers
    size = max(1, n // max(config.num_blocks, 1))
    window = max(min(j, size) + 1 + (1 if j > size else 0) for j in range(L))
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term(f"window of boundaries ({window - 1}) beyond the layer-0 states", (window - 1) * z.S, ""),
            _per_batch(z, 16 * z.Tb * z.d, "float64 last-token cosine"),
        ),
    )
    return [selection], 1.0, False, []


def _replaceme(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """ReplaceMe: UIDL's selection, then the dense target states, then one least-squares map per removed block.

    - linear_replacement: a second runner (the first stays alive), the dense state at the end of the block (S), the
      states propagated on the compressed model (S) and the boundary being computed; the float64 statistics MᵀM and
      Mᵀ(L − Y) (2·8·d²) with, while the fitted layer runs, each batch's float64 copies at the MLP hook
      (T_b·d·(24 + b)); the solve adds the identity, the jittered Gram matrix and its factor (3·8·d²); the fold, with
      the statistics and the map T (8·d²) still held, a float64 W_down and its product (2·8·d·i). With
      estimator="cosine" the fit keeps M, Y and L of every token in float32 (3·N·d·4, on the CPU) and their
      concatenation (the same again).
    Cost (a bound: it depends on where the block is): the selection walk (1), the dense walk up to the block's end
    (≤ 1), and the compressed model up to the last bridged layer, that layer twice (≤ (L − n + blocks)/L).
    """
    L, d, i = z.shape.num_layers, z.d, z.i
    phases, _, _, _ = _uidl(z, n, config)
    blocks = max(config.num_blocks, 1)
    statistics = 2 * 8 * d * d
    fit = max(
        z.run_outputs() + statistics + z.Tb * d * (24 + z.b) + 3 * d * z.Tb * z.b,
        statistics + 3 * 8 * d * d,
        statistics + 8 * d * d + 2 * 8 * d * i,
    )
    if config.estimator == "cosine":
        fit = max(fit, 2 * 3 * z.N * d * 4 + 3 * 4 * d * d)
    phases.append(
        Phase(
            "linear_replacement",
            (
                z.tokens(),
                *z.runners(2),
                Term("dense target states at the block's end", blocks * z.S, "taken before the layers are dropped"),
                Term("states propagated on the compressed model", z.S, ""),
                Term(
                    "largest of: a layer run, the statistics with one batch's float64 copies, the solve, the fold",
                    max(z.run_outputs() + z.block_forward(), fit),
                    "MᵀM and Mᵀ(L − Y) in float64 (2·8·d²); Cholesky with jitter (3·8·d² more)",
                ),
            ),
        )
    )
    passes = 2.0 + (L - n + blocks) / L
    return phases, passes, True, ["stack passes are a bound: they depend on where the removed block lies"]


def _come(z: _Sizes, n: int, config: Any) -> tuple[list[Phase], float, bool, list[str]]:
    """CoMe: n steps, each one pass over the current stack (Block Influence, angular distances, |activation| sums)
    and one merge of two layers into one of the same width.

    - selection: the runner's layer-0 states, the previous input and the current boundary (2S), the boundary being
      computed, and at the down-projection hook the float64 |activation| of one batch and its masked product
      (16·T_b·i) beside the MLP activation; or the float64 cosine of one batch (40·T_b·d); plus the merged blocks
      of the earlier steps (one layer each, n − 1 at most).
    - merge: copies of the two members (2 layers), the wide block (2 layers, built as FlattenGPT's: the last weight
      of the copy it starts from, d·i, is still held when the last concatenation lands), and the earlier merged
      blocks (a bound: a chain frees the block it merges again).
    Cost: step s runs the L − s layers of the current stack.
    """
    s = z.shape
    built = Term("merged blocks of the earlier steps", (n - 1) * s.layer_bytes, "kept until the plan is applied")
    at_hook = (2 * z.d + z.i) * z.Tb * z.b + 16 * z.Tb * z.i
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("the previous input and the current boundary", 2 * z.S, ""),
            built,
            Term(
                "largest per-batch work: a layer run with the |activation| hook, or the float64 cosine",
                max(z.run_outputs() + max(z.block_forward(), at_hook), 40 * z.Tb * z.d),
                "float64 |x| and its masked product at the down projection",
            ),
        ),
    )
    merge = Phase(
        "merge",
        (
            z.tokens(),
            *z.runners(1),
            built,
            Term(
                "member copies and the wide block, with the last weight of the copy it starts from",
                4 * s.layer_bytes + z.d * z.i * z.b,
                "as FlattenGPT's flatten: the wide block starts as a copy of the first member",
            ),
        ),
    )
    passes = sum((s.num_layers - step) / s.num_layers for step in range(n))
    return [selection, merge], passes, False, []


#: The methods whose workspace is modelled, each by a function documenting its terms.
ESTIMATORS: dict[str, Callable[[_Sizes, int, Any], tuple[list[Phase], float, bool, list[str]]]] = {
    "flattengpt": _flattengpt,
    "shortgpt": _shortgpt,
    "sleb": _sleb,
    "uidl": _uidl,
    "replaceme": _replaceme,
    "come": _come,
}


# ------------------------------------------------------------------------------------------------------ entry points
def estimate_memory(
    model: nn.Module,
    method: str,
    num_layers_to_remove: int,
    nsamples: int = 128,
    seqlen: int = 2048,
    batch_size: int = 8,
    method_args: dict[str, Any] | None = None,
    stack: str | None = None,
) -> MemoryEstimate:
    """The estimate for compressing `model` (real or on the meta device: only shapes are read).

    Raises:
        ValueError: a method that is not modelled, a target that removes no layer or every layer, or a model the
            method refuses (the same refusals as `FlattenQuantizer.compress`, before any work).
    """
    if method not in ESTIMATORS:
        raise ValueError(f"no memory model for method {method!r}; the estimate covers {sorted(ESTIMATORS)}.")
    calibration = CalibrationShape(nsamples, seqlen, batch_size)
    method_class = get_method_class(method)
    config = method_class.config_class(**(method_args or {}))
    adapter = get_adapter(model)
    require_capabilities(adapter, method)
    stack = stack or _single_stack(adapter)
    preflight(adapter, method_class(config), stack, Corrections())
    shape = ModelShape.of(model, stack)
    if (
        not isinstance(num_layers_to_remove, int)
        or isinstance(num_layers_to_remove, bool)
        or not 0 < num_layers_to_remove < shape.num_layers
    ):
        raise ValueError(
            f"num_layers_to_remove must be between 1 and {shape.num_layers - 1} for a stack of {shape.num_layers} "
            f"layers, got {num_layers_to_remove!r}."
        )
    phases, passes, bound, notes = ESTIMATORS[method](_Sizes(shape, calibration), num_layers_to_remove, config)
    return MemoryEstimate(
        method=method,
        num_layers_to_remove=num_layers_to_remove,
        model=shape,
        calibration=calibration,
        phases=phases,
        stack_passes=round(passes, 3),
        stack_passes_is_bound=bound,
        notes=notes,
    )


def estimate_checkpoint(
    source: str,
    method: str,
    num_layers_to_remove: int,
    nsamples: int = 128,
    seqlen: int = 2048,
    batch_size: int = 8,
    dtype: str = "float32",
    method_args: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> MemoryEstimate:
    """The estimate for a checkpoint folder, a Hub id (its config.json only) or a bundled name, without weights."""
    model = meta_model(source, dtype, trust_remote_code)
    result = estimate_memory(model, method, num_layers_to_remove, nsamples, seqlen, batch_size, method_args)
    result.source = source
    return result


def meta_model(source: str, dtype: str = "float32", trust_remote_code: bool = False) -> nn.Module:
    """The model of `source` built from its config on the meta device: every shape, no storage, nothing read but
    config.json (a bundled model's config comes from its cached conversion or its GGUF metadata)."""
    import transformers

    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}.")
    config = read_config(source, trust_remote_code)
    auto_map = getattr(config, "auto_map", None) or {}
    with torch.device("meta"):
        if trust_remote_code and auto_map:
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype), trust_remote_code=True
            )
        else:
            cls = model_class_for(config)
            build = cls.from_config if hasattr(cls, "from_config") else cls._from_config  # Auto class or concrete
            model = build(config, dtype=getattr(torch, dtype))
    return model.eval()


def read_config(source: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a folder, Hub id or bundled name (one-line errors, as the other commands)."""
    import transformers

    from . import bundled

    if source in bundled.BUNDLED_MODELS:
        return bundled.bundled_config(source)
    path = resolve_model_source(source)
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config of {source!r}: {one_line(error)}") from error
