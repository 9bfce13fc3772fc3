"""The memory model of the corrections folded at the cuts (`optimum-flatten estimate` with a linear replacement or a
compensation), in the terms of `compression.workspace`.

A correction is not a method: it runs inside the method's apply step (`compression.pipeline.apply_with_corrections_`)
and adds a phase of its own, timed under its name, plus what it holds *through* the method's apply. Its sizes follow
the code it describes:

- a linear bridge (`corrections.linear_bridge.bridged_apply_`): on its general path the dense model's states at the
  end of every bridged span are taken before the plan is applied and held through the method's apply (`dense_targets`:
  one state per span; a span holds at least one removed layer and one kept layer, so at most min(n, L − n) of them,
  times 1 + `correct_after`); then the compressed model is walked up to the last span, with the float64 normal
  equations of one fit (`BridgeFit`: width² and width × hidden, twice for ``lstsq_down``'s held-out batch) and one
  batch's float64 copies, beside the method's runner (the context keeps every runner it opened; the bridge's own is
  a second one unless the plan's can stand for it). ``cosine`` keeps the MLP's output, its stream and the target of
  every token as float32 host copies instead (`fit_cosine` reads the tokens themselves). One span after an unchanged
  prefix streams its statistics instead, holding a batch rather than the targets: the general path is the bound
  stated here (measured: within 25% where it runs, up to twice what a streamed fit holds);
- a compensation (`corrections.compensation.measure_scales`): one walk of the original layers up to the last dropped
  one, on a runner of its own, holding the stream and a layer's outputs (skipped when the method measured the factors
  in its own loop, as ShortGPT does: the bound again).
"""

from __future__ import annotations

from ..options.corrections import BridgeOptions, Corrections
from ..utils import flops
from .compute import ComputeModel, Tally
from .workspace import Phase, Term, WorkspaceSizes

#: Method phases that run before a bridge takes its dense targets (the plan is chosen before it is applied); every
#: other phase of a method runs inside its apply step, with the targets held.
PLANNING_PHASES = frozenset({"selection", "plan"})


def correction_workspace(
    z: WorkspaceSizes, n: int, corrections: Corrections, method_states: bool = True
) -> tuple[list[Phase], Term | None, float]:
    """(the correction's own phases, the term it holds through the method's apply phases or None, its stack passes as
    a bound) for removing `n` layers of the sizes `z`; nothing for ``Corrections()``. `method_states`: whether the
    method's runner still holds its layer-0 states (`CompressionMethod.keeps_runner_states`)."""
    runners = z.runners(2, states=2 if method_states else 1)
    if corrections.linear_replacement is not None:
        return _bridge(z, n, BridgeOptions(corrections.linear_replacement), runners)
    if corrections.compensation is not None:
        return _compensation(z, runners), None, 1.0
    return [], None, 0.0


def with_correction(
    z: WorkspaceSizes,
    n: int,
    corrections: Corrections,
    phases: list[Phase],
    passes: float,
    method_states: bool = True,
) -> tuple[list[Phase], float, list[str]]:
    """A method's phases and stack passes with `corrections` added (`correction_workspace`, `method_states` as
    there): the held term joins every phase but the planning ones, the correction's phases follow; and the notes
    that say so."""
    own, held, extra = correction_workspace(z, n, corrections, method_states)
    if not own:
        return phases, passes, []
    joined = [p if held is None or p.name in PLANNING_PHASES else Phase(p.name, (*p.terms, held)) for p in phases]
    if corrections.linear_replacement is not None:
        why = (
            "the dense states of every bridged span held through the method's apply, and the fit walking them (one "
            "least-squares bridge after an unchanged prefix streams a batch at a time instead)"
        )
    else:
        why = "one walk of the layers up to the last dropped one (none where the method measured the factors itself)"
    note = f"{corrections.describe()}, a bound: {why}; at most {extra:.2f} more stack passes"
    return [*joined, *own], passes + extra, [note]


def _bridged_spans(z: WorkspaceSizes, n: int, options: BridgeOptions) -> int:
    """At most how many spans get a bridge: each holds a removed and a kept layer (min(n, L − n)), and each adds
    `correct_after` kept layers' refits, never more than the kept layers."""
    L = z.shape.num_layers
    return min(min(n, L - n) * (1 + options.correct_after), L - n)


def _bridge(z: WorkspaceSizes, n: int, options: BridgeOptions, runners: list[Term]) -> tuple[list[Phase], Term, float]:
    L = z.shape.num_layers
    spans = _bridged_spans(z, n, options)
    targets = Term(
        f"dense states at the end of each bridged span (at most {spans})",
        spans * z.S,
        "dense_targets: taken before the plan is applied, held until every bridge is fitted",
    )
    d = z.d
    if options.estimator == "lstsq_down":
        width = z.i + 1  # the down projection's inputs, and an intercept where it has a bias (the bound)
        statistics = 2 * 8 * (width * width + width * d)  # the fit's and the held-out batch's normal equations
        why = "float64 AᵀA and Aᵀ(L − Y) of the down projection's inputs, and the same for the held-out batch"
    elif options.estimator == "cosine":
        width = d
        statistics = 3 * z.N * d * 4 + 2 * d * d * 4
        why = "float32 host copies of M, Y and L for every token (fit_cosine reads them), and T with its gradient"
    else:
        width = d + 1
        statistics = 8 * (width * width + width * d + (d * d if options.stream_gain else 0))
        why = "float64 MᵀM and Mᵀ(L − Y) (and the stream's cross terms with the gain)"
    batch = z.Tb * (width + 2 * d) * 8
    phase = Phase(
        "linear_replacement",
        (
            z.tokens(),
            *runners,
            targets,
            Term("the compressed model's states entering the layer walked", z.S, "one copy of every batch"),
            z.run_term(),
            Term("the fit's statistics", statistics, why),
            Term("one batch in float64", batch, "what the estimator reads, the target and the stream, masked"),
        ),
    )
    # The targets' walk of the dense stack up to the last span's end, the compressed model's up to the last bridged
    # layer (at most every layer of each), and each bridged layer once more for its fit.
    return [phase], targets, (2 * L - n + spans) / L


def _compensation(z: WorkspaceSizes, runners: list[Term]) -> list[Phase]:
    """measure_scales' walk: its runner beside the method's (the context keeps it), the stream, the previous
    output and a layer's run."""
    return [
        Phase(
            "compensation",
            (
                z.tokens(),
                *runners,
                Term("the stream entering the layer walked", z.S, "measure_scales: one copy of every batch"),
                Term("the layer before's output", z.S, "still referenced while the next layer runs"),
                z.run_term(),
            ),
        )
    ]


def with_correction_compute(
    z: WorkspaceSizes, n: int, corrections: Corrections, compute: ComputeModel | None
) -> ComputeModel | None:
    """A method's compute model with the correction's phase added: its stack passes (the bound of
    `correction_workspace`) and, for a least-squares bridge, the float64 normal equations of every span (the Gram and
    cross products over the calibration tokens, one factorisation each); None stays None."""
    own, _, passes = correction_workspace(z, n, corrections)
    if compute is None or not own:
        return compute
    name = own[0].name
    kinds: dict[str, dict[str, float]] = {}
    if corrections.linear_replacement is not None and corrections.linear_replacement != "cosine":
        options = BridgeOptions(corrections.linear_replacement)
        kinds = bridge_fit_tally(z, options.estimator).scaled(_bridged_spans(z, n, options))
    phase_passes = {**compute.phase_passes, name: compute.phase_passes.get(name, 0.0) + passes}
    arithmetic = {**compute.arithmetic, **({name: kinds} if kinds else {})}
    notes = [*compute.notes, f"{name}: the correction's passes are a bound (see the memory notes)"]
    return ComputeModel(phase_passes, arithmetic, notes)


def bridge_fit_tally(z: WorkspaceSizes, estimator: str, statistics: bool = True, solve: bool = True) -> Tally:
    """The arithmetic of one least-squares bridge, counted as `BridgeFit` does it: MᵀM and Mᵀ(L − Y) in float64 over
    the N calibration tokens (2·N·d² each; a third, MᵀY, with the stream gain), the Cholesky factor of MᵀM (d³/3)
    and its solve (2·d³; none for the diagonal map, d divisions), and the fold into the down projection (2·d²·i).
    ``"lstsq_down"`` fits over the MLP's width i instead (2·N·i² and 2·N·i·d, one i³/3 factor and its solve; the
    ridge search's extra solves are not counted). `statistics` and `solve` pick the parts: ReplaceMe's one-pass
    walk accumulates several starts' statistics in its selection and solves one of them afterwards."""
    d, i, N = z.d, z.i, z.N
    fit = Tally()
    width = i if estimator == "lstsq_down" else d
    if statistics:
        fit.add(flops.gram(N, width) + flops.gram(N, width, d), "float64")
        if estimator == "lstsq_gain":
            fit.add(flops.gram(N, d, d), "float64")
    if solve and estimator != "diagonal":
        fit.cholesky(width)
        fit.add(flops.cholesky_solve(width, 2 * d if estimator == "lstsq_gain" else d), "float64", "factorisation")
    if solve and estimator != "lstsq_down":
        fit.add(flops.product(d, d, i), "float64")
    return fit
