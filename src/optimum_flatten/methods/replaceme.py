"""ReplaceMe (Shopkhoev et al., NeurIPS 2025, arXiv 2505.02819): a removed block becomes one linear map.

Selection is UIDL's (the contiguous block with the smallest angular distance between its input and output; their
repository measures the last token), restricted to blocks that have a layer before them, because the map T is folded
into that layer's down projection. T maps that layer's MLP output M so that ``M T + Y`` approximates the block's
output L (Y: that layer's residual stream before its MLP): least squares in closed form, or the cosine distance by
Adam. See docs/methods/replaceme.md and `ops/linear_map.py` for the formulas.

Where its states come from (docs/methods/replaceme.md, "Cost"): held by the selection walk when its window fits
`held_states_gb`; else accumulated by a selection that walks once batch by batch (`replaceme_one_pass`) for a
shortlist of starts; else streamed by a second walk. The same map every way.

``selection="loss"`` (not in the paper) chooses the block by what the replacement leaves instead of by the angular
distance: for every start, T is fitted and the model with that block replaced is scored by next-token NLL on the first
calibration batches; the lowest wins. The distance says which block changes the stream least, the loss says which
block a linear map replaces best.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import CalibratedStates, HeldBlock, next_token_nll
from ..compression.compute import ComputeModel
from ..compression.correction_workspace import bridge_fit_tally
from ..compression.method import CompressionMethod, MethodContext, apply_layer_drop_
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes
from ..corrections.bridge_fit import LEAST_SQUARES_ESTIMATORS, BridgeFit, FilledBridge, fit_with_outputs
from ..corrections.compensation import require_compensable
from ..corrections.linear_bridge import bridged_apply_, require_bridgeable
from ..ops.linear_map import UPDATE_CHUNK_ROWS
from ..options.methods.replaceme import ReplaceMeConfig
from ..plan import LayerPlan
from ..registry import register_method
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import is_offloaded
from ..utils.torch_utils import count_parameters
from .replaceme_one_pass import walk_with_shortlist
from .uidl import UIDLMethod, block_size, holds_within, select_blocks_holding


@register_method("replaceme")
class ReplaceMeMethod(CompressionMethod):
    config_class = ReplaceMeConfig
    #: The map is folded after a layer's MLP output: into what writes it (`down_fold`), or, with estimator
    #: 'diagonal', into the gain of a norm after the MLP; `preflight` refuses a family that can hold neither.
    required_capabilities = frozenset({"layer_drop"})
    #: ReplaceMe is a linear replacement already; a second one on top would refit the same spans.
    accepts_linear_replacement = False
    #: The angular distances' sums and counts, and the bridge's normal equations, are summed over the ranks.
    shards_calibration = True
    config: ReplaceMeConfig

    def sharding_refusal(self) -> str | None:
        if self.config.selection == "loss":
            return "selection='loss' scores blocks on the first scoring_batches batches (use selection='distance')"
        if self.config.estimator == "cosine":
            return "estimator='cosine' runs Adam over the tokens themselves (use a least-squares estimator)"
        return None

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """ReplaceMe: UIDL's selection, then the least-squares map of the removed block, streamed or held.

        Streamed (one block, a least-squares estimator, no `correct_after`: `linear_bridge.streamed_span`): before
        the layers are dropped, one walk of the dense stack a batch at a time up to the block's end, on the
        selection's runner (`MethodContext.states_of_unchanged_model`: no second copy of the layer-0 states). At its
        largest a batch holds, beside the float64 statistics (MᵀM and Mᵀ(L − Y), 2·8·d²; with ``"lstsq_gain"`` MᵀY
        too, 8·d²), either a layer's run (its input, the captured M and Y and the block's temporaries: 3·T_b·d·b +
        block) or the update (M, Y and the target with their masked copies, 6·T_b·d·b, and the float64 rows of one
        chunk, C·d·8·(4 + 2 with a gain), C = min(T_b, 4096)); then the solve (the factor, 8·d²) and the fold (T,
        8·d², and a float64 W_down with its product, 2·8·d·i). With ``"lstsq_down"`` the statistics are AᵀA and
        Aᵀ(L − Y) over the MLP's intermediate width i (8·i² + 8·i·d, twice while the ridge is chosen on a held-out
        batch), the captured A is T_b·i·b, and the solve holds the i × i factor, the prior, the right-hand side, the
        solution and the held-out product (i × d each).
        Cost: the selection walk (1) and the dense walk up to the block's end (≤ 1).

        Held by the selection (the same case, with size + 4 copies of the calibration states within
        `held_states_gb`: `held_states`): the selection walk keeps its last size + 2 boundaries whole and the pair
        around the best block so far (`held_boundaries`: at the layer where the window and a pair it may have left
        behind are most), beside the layer it runs; the fit then holds that pair (2·S) and runs the layer before the
        block on it (its outputs, the captured MLP and the block's temporaries) beside the statistics. Cost: the
        selection walk and one layer.

        One pass (a window over `held_states_gb`, with at least one start's statistics within it: `one_pass_starts`):
        the selection walks batch by batch (`replaceme_one_pass`) beside the runner's layer-0 states, holding the
        last-token rows of every boundary, the statistics of the shortlisted starts, and for one batch the state
        entering and leaving a layer, the captured M and Y of the shortlisted blocks it is inside and the layer's
        temporaries or a block end's update; the fit is then a solve beside the chosen statistics, or, for a block off
        the shortlist, the streamed fit above (its phase is that bound). Cost: the walk and the probe batch (1 + 1/B).

        Held (otherwise): the selection's runner, the dense state at the end of every block (S each), the states
        propagated on the compressed model (S) and a run's outputs; the statistics with one batch's update; the
        solve and the fold as above. With estimator="cosine" the fit keeps M, Y and L of every token in float32
        (3·N·d·4, on the CPU) and their concatenation (the same again). Cost (a bound: it depends on where the block
        is): the selection walk (1), the dense walk up to the block's end (≤ 1), and the compressed model up to the
        last bridged layer, that layer twice (≤ (L − n + blocks)/L).
        """
        L, d, i, b, tb = z.shape.num_layers, z.d, z.i, z.b, z.Tb
        phases, _, _, _ = UIDLMethod.workspace(z, n, config)
        held = held_states(z, n, config)
        shortlisted = one_pass_starts(z, n, config)
        if held:
            size = n  # one block
            alive = held_boundaries(L, size)
            phases = [
                Phase(
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
                            "last-token rows of the distance window",
                            (size + 1) * z.cal.nsamples * d * b,
                            "one row a sequence",
                        ),
                        z.run_term(),
                    ),
                )
            ]
        blocks = max(config.num_blocks, 1)
        chunk = min(tb, UPDATE_CHUNK_ROWS)
        gain = config.estimator == "lstsq_gain"
        statistics = fit_statistics_bytes(z, config)
        update = 6 * tb * d * b + chunk * d * 8 * (4 + 2 * int(gain))
        solve = 8 * d * d * (3 if gain else 1)
        fold = 8 * d * d + 2 * 8 * d * i
        captured = 2 * tb * d * b
        if config.estimator == "lstsq_down":
            # The update's float64 rows a chunk at a time; a solve holds the factor (the ridge and jitter go on the
            # diagonal in place), the prior, the right-hand side, the solution and the held-out product (i × d each).
            update = 2 * tb * i * b + 4 * tb * d * b + chunk * (i + 3 * d) * 8
            solve, fold = 8 * i * i + 4 * 8 * i * d, 0
            captured = tb * (i + d) * b
        if held:
            run = z.run_outputs() + captured + z.block_forward()
            phases.append(
                Phase(
                    "linear_replacement",
                    (
                        z.tokens(),
                        *z.runners(1),
                        Term(
                            "states held by the selection", 2 * z.S, "the bridged layer's input and the block's output"
                        ),
                        Term(
                            "largest of: the layer's run or an update beside the statistics, the solve, the fold",
                            max(statistics + max(run, update), statistics + solve, statistics + fold),
                            "the float64 statistics; the layer's outputs so far and one batch's captured MLP",
                        ),
                    ),
                )
            )
            return phases, 1.0 + 1 / L, False, []
        if config.estimator in LEAST_SQUARES_ESTIMATORS and blocks == 1 and config.correct_after == 0:
            walk = captured + tb * d * b + z.block_forward()
            streamed = Phase(
                "linear_replacement",
                (
                    z.tokens(),
                    *z.runners(1),
                    Term(
                        "largest of: a batch's walk or update beside the statistics, the solve, the fold",
                        max(statistics + max(walk, update), statistics + solve, statistics + fold),
                        "the float64 statistics stream batch by batch: no calibration state is held",
                    ),
                ),
            )
            if shortlisted:
                in_flight = min(shortlisted, n + 1) * captured  # a batch's M and Y of the blocks it is inside
                batch = 2 * tb * d * b  # the batch entering the layer and leaving it
                selection = Phase(
                    "selection",
                    (
                        z.tokens(),
                        *z.runners(1),
                        Term(
                            "last-token rows of every boundary", (L + 1) * z.cal.nsamples * d * b, "one row a sequence"
                        ),
                        Term(
                            f"statistics of {shortlisted} shortlisted start{'s' if shortlisted > 1 else ''}",
                            shortlisted * statistics,
                            "float64, every batch added as it passes (methods/replaceme_one_pass.py)",
                        ),
                        Term(
                            "one batch through a layer, or a block's end added to its statistics",
                            batch + in_flight + max(z.block_forward(), update),
                            "the captured M and Y of the shortlisted blocks the batch is inside",
                        ),
                    ),
                )
                passes = 1.0 + 1 / z.cal.batches  # the walk and the probe batch
                note = "if the block chosen is not on the shortlist, its fit streams a walk up to its end (≤ 1 pass)"
                # The fit is a solve beside the chosen statistics, or off the shortlist the streamed walk: its bound.
                return [selection, streamed], passes, False, [note]
            phases.append(streamed)
            return phases, 2.0, True, ["stack passes are a bound: they depend on where the removed block lies"]
        fit = max(z.run_outputs() + statistics + update + 3 * d * tb * b, statistics + solve, statistics + fold)
        if config.estimator == "cosine":
            fit = max(fit, 2 * 3 * z.N * d * 4 + 3 * 4 * d * d)
        phases.append(
            Phase(
                "linear_replacement",
                (
                    z.tokens(),
                    *z.runners(1),
                    Term(
                        "dense target states at the blocks' ends", blocks * z.S, "taken before the layers are dropped"
                    ),
                    Term("states propagated on the compressed model", z.S, ""),
                    Term(
                        "largest of: a layer run, the statistics with one batch's update, the solve, the fold",
                        max(z.run_outputs() + z.block_forward(), fit),
                        "MᵀM and Mᵀ(L − Y) in float64 (2·8·d²); Cholesky with jitter (8·d² more)",
                    ),
                ),
            )
        )
        passes = 2.0 + (L - n + blocks) / L
        return phases, passes, True, ["stack passes are a bound: they depend on where the removed block lies"]

    @classmethod
    def compute(cls, z: WorkspaceSizes, n: int, config: Any) -> ComputeModel | None:
        """ReplaceMe's compute model: the selection walk (one stack pass, no arithmetic), then per bridged block its
        normal equations, counted as the fit does (`compression.correction_workspace.bridge_fit_tally`). None for the
        cosine fit and the loss selection, which are not modelled.
        """
        if config.estimator == "cosine" or config.selection == "loss":
            return None
        L = z.shape.num_layers
        blocks = max(config.num_blocks, 1) * (1 + config.correct_after)
        fit = bridge_fit_tally(z, config.estimator)
        notes = ["the linear replacement's stack passes are a bound: they depend on where the removed block lies"]
        replacement = 1.0 + (L - n + blocks) / L
        if held_states(z, n, config):
            notes, replacement = [], 1 / L  # the layer before the block, on the states the selection held
        down_note = ["the down refit's ridge search solves are not counted"] if config.estimator == "lstsq_down" else []
        shortlisted = one_pass_starts(z, n, config)
        if shortlisted:  # the walk and the probe batch; every shortlisted start's statistics, then one solve
            statistics = bridge_fit_tally(z, config.estimator, solve=False)
            return ComputeModel(
                {"selection": 1.0 + 1 / z.cal.batches, "linear_replacement": 0.0},
                {
                    "selection": statistics.scaled(shortlisted),
                    "linear_replacement": bridge_fit_tally(z, config.estimator, statistics=False).scaled(1),
                },
                ["if the block chosen is not on the shortlist, its fit streams a walk up to its end", *down_note],
            )
        return ComputeModel(
            {"selection": 1.0, "linear_replacement": replacement},
            {"linear_replacement": fit.scaled(blocks)},
            notes + down_note,
        )

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        require_bridgeable(adapter, stack, "method 'replaceme'", self.config.estimator)
        if self.config.bridge_options().stream_gain:
            require_compensable(adapter, stack)
        if self.config.selection == "loss" and adapter.lm_head(stack) is None:
            raise UnsupportedArchitectureError(
                f"replaceme with selection='loss' scores blocks by next-token loss, and this "
                f"{type(adapter.model).__name__} has no LM head reading the {stack!r} stack; use selection='distance'."
            )

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        self._held: tuple[MethodContext, HeldBlock | FilledBridge] | None = None
        if self.config.selection == "distance":
            budget = self.config.held_states_gb * 1e9 if self._may_hold_states(adapter, context) else 0.0
            walk_once = None
            if self._may_walk_once(adapter, context, budget):

                def walk_once(states: CalibratedStates, size: int) -> tuple[dict[int, float], FilledBridge | None]:
                    return self._walk_once(adapter, context, states, size, budget)

            plan, held = select_blocks_holding(adapter, context, num_to_remove, self.config, 1, budget, walk_once)
            if held is not None:
                self._held = (context, held)
            return plan
        return self._select_by_loss(adapter, context, num_to_remove)

    def _may_walk_once(self, adapter: ArchitectureAdapter, context: MethodContext, budget: float) -> bool:
        """Whether a one-pass walk could keep at least one start's statistics within `budget` (sized on the meta
        device, allocating nothing), with a shortlist asked for and the distance on the last token (whose rows are
        all the walk keeps of the states)."""
        if budget <= 0 or self.config.fit_shortlist == 0 or self.config.tokens != "last":
            return False
        layer = adapter.layers(context.stack)[0]
        options = self.config.bridge_options()
        return BridgeFit(adapter, layer, 0, options, len(context.batches), "meta").nbytes <= budget

    def _walk_once(
        self,
        adapter: ArchitectureAdapter,
        context: MethodContext,
        states: CalibratedStates,
        size: int,
        budget: float,
    ) -> tuple[dict[int, float], FilledBridge | None]:
        """The selection and the fit's statistics in one walk batch by batch (`replaceme_one_pass`), for a window
        over `held_states_gb`: the shortlisted starts' statistics take the budget instead."""
        runner = states.runner
        options = self.config.bridge_options()

        def new_fit(start: int, device: torch.device | str) -> BridgeFit:
            return BridgeFit(adapter, states.layers[start - 1], start - 1, options, runner.num_batches, device)

        with context.progress_bar(runner.num_batches, "replaceme: one pass") as bar:
            walk = walk_with_shortlist(
                adapter, states, size, 1, self.config.fit_shortlist, budget, new_fit, on_batch=lambda _b: bar.update()
            )
        filled = walk.filled(size)
        context.report["one_pass"] = {
            "probe_batches": 1,
            "shortlist": walk.shortlist,
            "chosen_on_shortlist": filled is not None,
        }
        return walk.distances, filled

    def _may_hold_states(self, adapter: ArchitectureAdapter, context: MethodContext) -> bool:
        """Whether the fit could read states the selection walk held (`fit_reads_held_states`), with no offloaded
        layer (the fit then holds the states its own way, `linear_bridge.streamed_span`, and a held pair would only
        add to them)."""
        if not fit_reads_held_states(self.config):
            return False
        return not any(is_offloaded(layer) for layer in adapter.layers(context.stack))

    def _select_by_loss(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        """For every start s >= 1: fit T on layer s-1 towards the state after the block, run the layers after the
        block on the scored batches from ``Y + M T``, take the NLL. One walk down the stack keeps only the boundaries
        a start needs (n + 2 of them), so memory does not grow with depth."""
        num_layers = adapter.num_layers(context.stack)
        # The maps a start is scored with: the estimator's own where the search can fit it in closed form (the gain,
        # the diagonal), plain least squares for the down refit and the cosine fit.
        search = self.config.estimator if self.config.estimator in ("lstsq_gain", "diagonal") else "lstsq"
        size = block_size(num_to_remove, 1, num_layers, first_start=1)
        runner = context.new_runner(adapter)
        layers = list(adapter.layers(context.stack))
        limit = min(self.config.scoring_batches or runner.num_batches, runner.num_batches)
        scored = list(context.batches)[:limit]
        head_weights = count_parameters(adapter.lm_head(context.stack))
        window: deque[list[torch.Tensor]] = deque([runner.inputs], maxlen=size + 2)
        losses: dict[int, float] = {}
        with context.timer("selection"), context.progress_bar(num_layers - size, "replaceme blocks") as bar:
            for index, layer in enumerate(layers):
                window.append(runner.run(layer, index, window[-1]))
                start = index + 1 - size  # the block [start, index] ends here; window[-1] leaves it
                if start < 1 or len(window) < size + 2:
                    continue
                _, current = fit_with_outputs(
                    adapter, runner, layers[start - 1], start - 1, window[0], window[-1], limit, search
                )
                for later in range(index + 1, num_layers):
                    current = runner.run(layers[later], later, current)
                losses[start] = next_token_nll(adapter, current, scored, context.stack)
                context.extra_work += head_weights * sum(int(h.shape[0] * h.shape[1]) for h in current)
                bar.update()
        start = min(losses, key=lambda s: (losses[s], s))
        context.report["block_losses"] = {str(s): round(v, 6) for s, v in losses.items()}
        context.report["blocks"] = [[start, start + size]]
        removed = set(range(start, start + size))
        return LayerPlan.from_kept(num_layers, [i for i in range(num_layers) if i not in removed], stack=context.stack)

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        held, self._held = getattr(self, "_held", None), None
        context.report["replaceme"] = bridged_apply_(
            adapter,
            plan,
            context,
            self.config.bridge_options(),
            lambda: apply_layer_drop_(adapter, plan),
            seed=self.config.seed,
            held=held[1] if held is not None and held[0] is context else None,
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
