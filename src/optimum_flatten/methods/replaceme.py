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
from collections.abc import Callable
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import CalibratedStates, HeldBlock, next_token_nll
from ..compression.compute import ComputeModel
from ..compression.correction_workspace import bridge_fit_tally
from ..compression.method import LinearReplacementMethod, MethodContext, apply_layer_drop_
from ..compression.workspace import WorkspaceModel, WorkspaceSizes
from ..corrections.bridge_fit import BridgeFit, FilledBridge, LayerRun, fit_with_outputs
from ..corrections.compensation import require_compensable
from ..corrections.linear_bridge import bridged_apply_, require_bridgeable
from ..options.methods.replaceme import ReplaceMeConfig
from ..plan import LayerPlan
from ..registry import register_method
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import is_offloaded
from ..utils.torch_utils import count_parameters
from .replaceme_one_pass import walk_with_shortlist
from .replaceme_workspace import fit_reads_held_states, held_states, one_pass_starts, replaceme_workspace
from .uidl import block_size, select_blocks_holding


@register_method("replaceme")
class ReplaceMeMethod(LinearReplacementMethod):
    """The map is folded after a layer's MLP output: into what writes it (`down_fold`), or, with estimator 'diagonal',
    into the gain of a norm after the MLP; `preflight` refuses a family that can hold neither."""

    config_class = ReplaceMeConfig
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
        """ReplaceMe's memory model (`replaceme_workspace`)."""
        return replaceme_workspace(z, n, config)

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

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        blocks = self.config.num_blocks if self.config.selection == "distance" else 1  # the loss search: one block
        block_size(num_to_remove, blocks, num_layers, first_start=1)

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
                run = LayerRun(adapter, runner, layers[start - 1], start - 1, window[0], window[-1])
                _, current = fit_with_outputs(run, limit, search)
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
