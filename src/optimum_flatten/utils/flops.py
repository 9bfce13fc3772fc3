"""The method's own arithmetic, counted from shapes where it happens: one machine-free unit beside the stack passes.

Stack passes (`LayerwiseRunner.work`) count the layer runs a method makes. What they do not show is what a method
computes *between* layer runs: the second moments and cross moments of activations (a tokens × width² product each),
the head scores, the Cholesky factorisations and the triangular solves. At LLaMA-2-7B shape that is most of
FlattenGPT's time on a GPU (issue 31), so a report that only gives stack passes hides the larger cost.

One mechanism serves every method: the functions in `ops/` and `calibration/` (stats, precision, cross_moment) that
do the arithmetic call `record(flops, precision, kind)` with the floating-point operations their shapes imply (the
formulas below, the same ones the estimate uses), and `MethodContext.timer(phase)` opens an `ArithmeticCount` phase
while it times. So the count lands in the phases the report times, without a method writing any count of its own,
and a session without a GPU sees the work the GPU will do. Counting costs a few integer products per call: nothing
beside the work counted.

Conventions (the usual LAPACK operation counts, multiply and add each one flop):

- a product of (m × k) by (k × n) is 2·m·k·n, symmetric or not (torch computes the full product);
- a Cholesky factorisation of n × n is n³/3; a triangular solve of n × n against r columns n²·r; a solve with a
  Cholesky factor (two triangular solves) 2·n²·r; the inverse from a Cholesky factor 2·n³ (torch's CUDA
  `cholesky_inverse` solves against the identity; LAPACK's potri would do 2n³/3, so this counts what the GPU does);
- elementwise work (centring, casts, norms, masks) is not counted: it moves memory and is a small part of the
  products it feeds; each scalar read of a device tensor into Python (`float(t[i])` in a loop) is counted apart,
  as ``host_reads``: each one waits for the device, which the flops cannot show; so are the kernels of a Python
  loop over small blocks (``launches``), where each op's launch costs more than its arithmetic.

The precision is the one the arithmetic runs in as the options ask for it (``"tf32"`` when TF32 products are
requested, even on a CPU that has none): what a GPU would run, which is what the count is for.

The unit a report converts to is one dense forward of the original stack over the same calibration tokens
(`dense_forward_flops`): 2 × stack weights × tokens, plus attention's two token-pair products, 4 · seqlen ·
(heads · head_dim) per token and layer (the full square, as PaLM's accounting, Chowdhery et al. 2022, App. B;
a causal kernel skips about half of it). In a mixture of experts the weights are those a token is multiplied by:
the router, its top-k routed experts and any shared expert, not every expert the layer holds
(`adapters.moe.unrouted_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

#: The precisions the arithmetic is counted in (the device presets give a peak for each).
PRECISIONS = ("bfloat16", "float16", "tf32", "float32", "float64")
#: What the arithmetic is: a matrix product (GEMM), a factorisation or triangular solve (less parallel, slower per
#: flop on every device); and, counted in events rather than flops, scalar reads into Python and the launches of
#: small kernels in a Python loop (where the launch, not the work, sets the time).
KINDS = ("product", "factorisation", "host_reads", "launches")
#: The kinds counted in events, not flops.
EVENT_KINDS = ("host_reads", "launches")


def product(m: int, k: int, n: int) -> int:
    """(m × k) @ (k × n)."""
    return 2 * m * k * n


def gram(tokens: int, dim: int, other: int | None = None) -> int:
    """Xᵀ Y over `tokens` rows, X of width `dim` and Y of width `other` (default: Xᵀ X): a second or cross moment."""
    return 2 * tokens * dim * (dim if other is None else other)


def lower_gram(tokens: int, dim: int, band: int) -> int:
    """Xᵀ X over `tokens` rows on its lower block triangle only, in bands of `band` columns (each band the rows from
    its first column on): (dim + band)/(2·dim) of `gram` when the band divides the width."""
    return sum(product(dim - start, tokens, min(band, dim - start)) for start in range(0, dim, band))


def cholesky(n: int) -> float:
    return n**3 / 3


def triangular_solve(n: int, columns: int) -> int:
    return n * n * columns


def cholesky_solve(n: int, columns: int) -> int:
    return 2 * n * n * columns


def cholesky_inverse(n: int) -> int:
    return 2 * n**3


def dense_forward_flops(stack_weights: int, tokens: int, seqlen: int, num_layers: int, attention_width: int) -> float:
    """One forward of a stack of `num_layers` layers over `tokens` tokens in sequences of `seqlen`: 2·weights·tokens +
    4·seqlen·attention_width per token and layer (attention_width = heads · head_dim). `stack_weights` are the
    weights one token is multiplied by: all of a dense stack's, a mixture's routed experts only.
    """
    return 2.0 * stack_weights * tokens + 4.0 * tokens * seqlen * attention_width * num_layers


def precision_of(dtype: Any, tf32: bool = False) -> str:
    """The precision name of a torch dtype (or its name), ``"tf32"`` for float32 with TF32 products requested."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32" and tf32:
        return "tf32"
    if name == "half":
        return "float16"
    if name == "double":
        return "float64"
    if name == "float":
        return "tf32" if tf32 else "float32"
    return name


@dataclass
class ArithmeticCount:
    """Flops per phase, kind and precision; `record` adds to every phase open at the time (phases nest, as the timers
    do: an outer phase counts what its inner ones do)."""

    phases: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    open: list[str] = field(default_factory=list)

    def add(self, flops: float, precision: str, kind: str = "product") -> None:
        if not flops:
            return
        for name in dict.fromkeys(self.open):  # a phase opened twice (re-entered) counts once
            kinds = self.phases.setdefault(name, {})
            by_precision = kinds.setdefault(kind, {})
            by_precision[precision] = by_precision.get(precision, 0.0) + float(flops)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Counts what is recorded until the block ends into phase `name` (and the phases already open)."""
        token = _ACTIVE.set((*_ACTIVE.get(), self)) if self not in _ACTIVE.get() else None
        self.open.append(name)
        self.phases.setdefault(name, {})
        try:
            yield
        finally:
            self.open.pop()
            if token is not None:
                _ACTIVE.reset(token)

    def flops(self, phase: str) -> float:
        """Flops of `phase`, every kind but host reads."""
        return _flops_of(self.phases.get(phase, {}))

    def host_reads(self, phase: str) -> float:
        return sum(self.phases.get(phase, {}).get("host_reads", {}).values())

    def launches(self, phase: str) -> float:
        return sum(self.phases.get(phase, {}).get("launches", {}).values())

    def to_dict(self, unit_flops: float | None = None) -> dict[str, Any]:
        """Per phase: flops by kind and precision, and, given `unit_flops`, the flops in that unit."""
        result: dict[str, Any] = {}
        for name, kinds in self.phases.items():
            entry: dict[str, Any] = {kind: {p: float(v) for p, v in values.items()} for kind, values in kinds.items()}
            if unit_flops:
                entry["dense_forwards"] = round(_flops_of(kinds) / unit_flops, 4)
            result[name] = entry
        return result


def _flops_of(kinds: dict[str, dict[str, float]]) -> float:
    return sum(v for kind, values in kinds.items() if kind not in EVENT_KINDS for v in values.values())


#: The counts open in this thread or task (a context may run inside another's phase: `auto` scores candidates on
#: sub-contexts while its own selection is timed; both count).
_ACTIVE: ContextVar[tuple[ArithmeticCount, ...]] = ContextVar("optimum_flatten_arithmetic", default=())


def record(flops: float, precision: str, kind: str = "product") -> None:
    """Adds `flops` of `kind` in `precision` to every open phase of every active count (nothing when none is open:
    the ops cost the same called outside a compression)."""
    for count in _ACTIVE.get():
        count.add(flops, precision, kind)


def record_host_reads(reads: int) -> None:
    """`reads` scalar reads of device values into Python: each waits for the device (a sync on a GPU)."""
    record(reads, "count", "host_reads")


def record_launches(kernels: int) -> None:
    """`kernels` launches of small kernels in a Python loop: each costs its launch more than its arithmetic."""
    record(kernels, "count", "launches")
