"""ReplaceMe's memory model for `optimum-flatten estimate` (`ReplaceMeMethod.workspace`): what its selection and its
linear replacement hold at their peaks, on each of the four ways its fit gets its states.

Laid out as FlattenGPT's is (`methods/flattengpt/workspace.py`): `ReplaceMeSizes` computes once what the phases
share (the fit's statistics and its update, solve and fold), and each phase is one function listing its terms;
`replaceme_workspace` picks the phases of the way the run takes (`held_states`, `one_pass_starts`).
"""

from __future__ import annotations

from typing import Any

from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes
from ..corrections.bridge_fit import LEAST_SQUARES_ESTIMATORS
from ..ops.linear_map import UPDATE_CHUNK_ROWS
from .uidl import UIDLMethod, holds_within

#: The note of the paths whose stack passes depend on where the removed block lies.
BOUND_NOTE = "stack passes are a bound: they depend on where the removed block lies"


def replaceme_workspace(z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
    """ReplaceMe: UIDL's selection, then the least-squares map of the removed block, streamed or held.

    Four ways, one phase list each: held by the selection (`held_selection_phase`, `held_fit_phase`); one pass
    (`one_pass_selection_phase`, then `streamed_fit_phase` as the bound of a block off the shortlist); streamed
    (UIDL's selection, `streamed_fit_phase`); held otherwise (UIDL's selection, `dense_targets_phase`).
    Cost: held by the selection, the selection walk and one layer; one pass, the walk and the probe batch
    (1 + 1/B); streamed, the selection walk (1) and the dense walk up to the block's end (≤ 1); otherwise (a bound:
    it depends on where the block is) the selection walk (1), the dense walk up to the block's end (≤ 1), and the
    compressed model up to the last bridged layer, that layer twice (≤ (L − n + blocks)/L).
    """
    f = ReplaceMeSizes(z, n, config)
    if held_states(z, n, config):
        return [held_selection_phase(z, n), held_fit_phase(f)], 1.0 + 1 / f.L, False, []
    if config.selection == "loss":
        selection, passes = loss_selection(z, n, config)
        uidl_phases, selection_passes = [selection], passes
    else:
        uidl_phases, selection_passes = UIDLMethod.workspace(z, n, config)[0], 1.0
    if config.estimator in LEAST_SQUARES_ESTIMATORS and f.blocks == 1 and config.correct_after == 0:
        shortlisted = one_pass_starts(z, n, config)
        if shortlisted:
            note = "if the block chosen is not on the shortlist, its fit streams a walk up to its end (≤ 1 pass)"
            # The fit is a solve beside the chosen statistics, or off the shortlist the streamed walk: its bound.
            phases = [one_pass_selection_phase(f, shortlisted), streamed_fit_phase(f)]
            return phases, 1.0 + 1 / z.cal.batches, False, [note]
        return [*uidl_phases, streamed_fit_phase(f)], selection_passes + 1.0, True, [BOUND_NOTE]
    passes = selection_passes + 1.0 + (f.L - n + f.blocks) / f.L
    return [*uidl_phases, dense_targets_phase(f)], passes, True, [BOUND_NOTE]


def loss_selection(z: WorkspaceSizes, n: int, config: Any) -> tuple[Phase, float]:
    """ReplaceMe's loss search (``selection="loss"``, `ReplaceMeMethod._select_by_loss`) and its stack passes.

    One walk down the stack keeps the last size + 2 boundaries (S each, every batch); at each start it fits a plain
    least-squares map from a run of layer s − 1 over every batch (`fit_with_outputs`: its float64 statistics, 2·8·d²,
    the captured M and Y of the scored batches, a fraction f of S each, and the map's outputs, f·S, one batch's
    float64 product at a time), runs the layers after the block from them and takes the next-token loss (one row's
    logits, 12·seqlen·V, or a layer run's outputs and temporaries). Cost: the walk (1), and per start s = 1 … L − size
    layer s − 1 on every batch, then on the scored batches the L − s − size layers after the block and one LM head:
    Σ(1 + f·(L − s − size + h))/L with h the head's weights over a layer's. The LM head dominates where the vocabulary
    is large beside the hidden size.
    """
    s, L = z.shape, z.shape.num_layers
    size = n  # the search removes one block of n layers
    scored = min(config.scoring_batches or z.cal.batches, z.cal.batches)
    fraction = scored / z.cal.batches
    scored_states = int(z.S * fraction)
    nll = 12 * z.cal.seqlen * s.vocab_size
    phase = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term(f"the walk's last {size + 2} boundaries", (size + 2) * z.S, "the block, its input and its output"),
            Term(
                "a start's fit: its statistics, the scored batches' M and Y and the map's outputs on them",
                2 * 8 * z.d * z.d + 3 * scored_states + 2 * 8 * z.Tb * z.d,
                f"plain least squares, fraction {fraction:g}",
            ),
            Term(
                "the suffix after the block: its input, and a layer run or one row's next-token loss",
                scored_states + max(int(z.run_outputs() * fraction) + z.block_forward(), nll),
                "run outputs + block temporaries, or logits (seqlen × V) with their float32 copies",
            ),
        ),
    )
    head = s.head_weights / s.layer_weights
    starts = range(1, L - size + 1)
    work = sum(1 + fraction * (L - start - size + head) for start in starts)
    return phase, 1.0 + work / L


class ReplaceMeSizes:
    """What the phases of one ReplaceMe request share: the float64 statistics of the fit (`fit_statistics_bytes`),
    one batch's update into them, the solve, the fold, and the captured activations of one batch.

    Per batch: the update holds M, Y and the target with their masked copies (6·T_b·d·b) and the float64 rows of
    one chunk (C·d·8·(4 + 2 with a gain), C = min(T_b, 4096)); the solve the factor (8·d², with ``"lstsq_gain"``
    MᵀY too); the fold T (8·d²) and a float64 W_down with its product (2·8·d·i). With ``"lstsq_down"`` the
    statistics are AᵀA and Aᵀ(L − Y) over the MLP's intermediate width i, the captured A is T_b·i·b, and the solve
    holds the i × i factor, the prior, the right-hand side, the solution and the held-out product (i × d each).
    """

    def __init__(self, z: WorkspaceSizes, n: int, config: Any) -> None:
        self.z, self.n, self.config = z, n, config
        self.L, d, i, b, tb = z.shape.num_layers, z.d, z.i, z.b, z.Tb
        self.blocks = max(config.num_blocks, 1)
        chunk = min(tb, UPDATE_CHUNK_ROWS)
        gain = config.estimator == "lstsq_gain"
        self.statistics = fit_statistics_bytes(z, config)
        self.update = 6 * tb * d * b + chunk * d * 8 * (4 + 2 * int(gain))
        self.solve = 8 * d * d * (3 if gain else 1)
        self.fold = 8 * d * d + 2 * 8 * d * i
        self.captured = 2 * tb * d * b
        if config.estimator == "lstsq_down":
            # The update's float64 rows a chunk at a time; a solve holds the factor (the ridge and jitter go on the
            # diagonal in place), the prior, the right-hand side, the solution and the held-out product (i × d each).
            self.update = 2 * tb * i * b + 4 * tb * d * b + chunk * (i + 3 * d) * 8
            self.solve, self.fold = 8 * i * i + 4 * 8 * i * d, 0
            self.captured = tb * (i + d) * b

    def fit_peak(self, run: int) -> int:
        """The largest of: `run` or an update beside the statistics, the solve, the fold (each beside them)."""
        s = self.statistics
        return max(s + max(run, self.update), s + self.solve, s + self.fold)


def held_selection_phase(z: WorkspaceSizes, n: int) -> Phase:
    """Held by the selection (one block, size + 4 copies of the calibration states within `held_states_gb`): the
    selection walk keeps its last size + 2 boundaries whole and the pair around the best block so far
    (`held_boundaries`: at the layer where the window and a pair it may have left behind are most), beside the
    layer it runs."""
    size = n  # one block
    alive = held_boundaries(z.shape.num_layers, size)
    return Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term(
                f"whole boundaries held beyond the layer-0 states ({alive})",
                alive * z.S,
                "the window of size + 2 and the best block's pair, at the worst layer for them",
            ),
            Term(
                "last-token rows of the distance window", (size + 1) * z.cal.nsamples * z.d * z.b, "one row a sequence"
            ),
            z.run_term(),
        ),
    )


def held_fit_phase(f: ReplaceMeSizes) -> Phase:
    """The fit on the states the selection held: that pair (2·S), and the layer before the block run on it (its
    outputs, the captured MLP and the block's temporaries) beside the statistics; then the solve and the fold."""
    z = f.z
    return Phase(
        "linear_replacement",
        (
            z.tokens(),
            *z.runners(1),
            Term("states held by the selection", 2 * z.S, "the bridged layer's input and the block's output"),
            Term(
                "largest of: the layer's run or an update beside the statistics, the solve, the fold",
                f.fit_peak(z.run_outputs() + f.captured + z.block_forward()),
                "the float64 statistics; the layer's outputs so far and one batch's captured MLP",
            ),
        ),
    )


def streamed_fit_phase(f: ReplaceMeSizes) -> Phase:
    """Streamed (one block, a least-squares estimator, no `correct_after`: `linear_bridge.streamed_span`): before the
    layers are dropped, one walk of the dense stack a batch at a time up to the block's end, on the selection's
    runner (`MethodContext.states_of_unchanged_model`: no second copy of the layer-0 states). At its largest a batch
    holds, beside the statistics, either a layer's run (its input, the captured M and Y and the block's
    temporaries: 3·T_b·d·b + block) or the update; then the solve and the fold."""
    z = f.z
    walk = f.captured + z.Tb * z.d * z.b + z.block_forward()
    return Phase(
        "linear_replacement",
        (
            z.tokens(),
            *z.runners(1),
            Term(
                "largest of: a batch's walk or update beside the statistics, the solve, the fold",
                f.fit_peak(walk),
                "the float64 statistics stream batch by batch: no calibration state is held",
            ),
        ),
    )


def one_pass_selection_phase(f: ReplaceMeSizes, shortlisted: int) -> Phase:
    """One pass (a window over `held_states_gb`, with at least one start's statistics within it: `one_pass_starts`):
    the selection walks batch by batch (`replaceme_one_pass`) beside the runner's layer-0 states, holding the
    last-token rows of every boundary, the statistics of the shortlisted starts, and for one batch the state entering
    and leaving a layer, the captured M and Y of the shortlisted blocks it is inside and the layer's temporaries or a
    block end's update."""
    z = f.z
    in_flight = min(shortlisted, f.n + 1) * f.captured  # a batch's M and Y of the blocks it is inside
    batch = 2 * z.Tb * z.d * z.b  # the batch entering the layer and leaving it
    return Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("last-token rows of every boundary", (f.L + 1) * z.cal.nsamples * z.d * z.b, "one row a sequence"),
            Term(
                f"statistics of {shortlisted} shortlisted start{'s' if shortlisted > 1 else ''}",
                shortlisted * f.statistics,
                "float64, every batch added as it passes (methods/replaceme_one_pass.py)",
            ),
            Term(
                "one batch through a layer, or a block's end added to its statistics",
                batch + in_flight + max(z.block_forward(), f.update),
                "the captured M and Y of the shortlisted blocks the batch is inside",
            ),
        ),
    )


def dense_targets_phase(f: ReplaceMeSizes) -> Phase:
    """Held (otherwise): the selection's runner, the dense state at the end of every block (S each), the states
    propagated on the compressed model (S) and a run's outputs; the statistics with one batch's update; the solve
    and the fold. With estimator="cosine" the fit keeps M, Y and L of every token in float32 (3·N·d·4, on the CPU)
    and their concatenation (the same again)."""
    z, d = f.z, f.z.d
    s = f.statistics
    fit = max(z.run_outputs() + s + f.update + 3 * d * z.Tb * z.b, s + f.solve, s + f.fold)
    if f.config.estimator == "cosine":
        fit = max(fit, 2 * 3 * z.N * d * 4 + 3 * 4 * d * d)
    return Phase(
        "linear_replacement",
        (
            z.tokens(),
            *z.runners(1),
            Term("dense target states at the blocks' ends", f.blocks * z.S, "taken before the layers are dropped"),
            Term("states propagated on the compressed model", z.S, ""),
            Term(
                "largest of: a layer run, the statistics with one batch's update, the solve, the fold",
                max(z.run_outputs() + z.block_forward(), fit),
                "MᵀM and Mᵀ(L − Y) in float64 (2·8·d²); Cholesky with jitter (8·d² more)",
            ),
        ),
    )


def fit_reads_held_states(config: Any) -> bool:
    """Whether the fit can read states the selection walk holds: one block chosen by distance, fitted by least
    squares with no later refit (the case whose fit streams a second walk otherwise)."""
    if config.selection != "distance" or config.num_blocks != 1 or config.correct_after:
        return False
    return config.estimator in LEAST_SQUARES_ESTIMATORS


def held_states(z: WorkspaceSizes, n: int, config: Any) -> bool:
    """Whether the selection walk holds the states around the block for the fit (`ReplaceMeMethod.plan`), as the
    estimate sees it: `fit_reads_held_states`, and the walk within `held_states_gb` (`holds_within`)."""
    return fit_reads_held_states(config) and holds_within(n, z.S, getattr(config, "held_states_gb", 0.0) * 1e9)


def fit_statistics_bytes(z: WorkspaceSizes, config: Any) -> int:
    """Bytes of one bridge's float64 statistics (`BridgeFit.nbytes`): MᵀM and Mᵀ(L − Y), 2·8·d² (with
    ``"lstsq_gain"`` MᵀY too); with ``"lstsq_down"`` AᵀA and Aᵀ(L − Y) over the intermediate width i, twice while
    its ridge is chosen on a held-out batch."""
    d, i = z.d, z.i
    if config.estimator == "lstsq_down":
        sets = 2 if config.down_ridge is None and z.cal.batches > 1 else 1
        return sets * (8 * i * i + 8 * i * d)
    return (2 + int(config.estimator == "lstsq_gain")) * 8 * d * d


def one_pass_starts(z: WorkspaceSizes, n: int, config: Any) -> int:
    """How many starts ReplaceMe's one-pass walk accumulates statistics for (`ReplaceMeMethod._may_walk_once`),
    as the estimate sees it: 0 where the walk holds the window instead (`held_states`) or does not walk once."""
    if held_states(z, n, config) or not fit_reads_held_states(config) or config.tokens != "last":
        return 0
    budget = getattr(config, "held_states_gb", 0.0) * 1e9
    return max(0, min(config.fit_shortlist, int(budget // fit_statistics_bytes(z, config)), z.shape.num_layers - n))


def held_boundaries(num_layers: int, size: int) -> int:
    """The most whole boundaries a holding selection walk keeps beyond the runner's layer-0 states, while a layer
    runs: its window (the last size + 2 boundaries up to the one entering the layer) and the pair around the best
    start measured so far (entering layer start − 1, leaving the block), which may lie behind the window. The
    worst over the layers and over which start is best (boundary 0 is the runner's own states)."""
    most = 0
    for i in range(num_layers):
        window = set(range(max(0, i - size - 1), i + 1))
        pairs = [{s - 1, s + size} for s in range(1, i - size + 1)] or [set()]
        most = max(most, max(len((window | pair) - {0}) for pair in pairs))
    return most
