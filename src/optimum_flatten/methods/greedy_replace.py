"""``method="greedy_replace"``: one layer at a time, drop it or replace it by a fitted map, whichever costs least.

A hybrid of SLEB (Song et al., 2024: remove the layer whose removal raises the calibration NLL least, re-score) and
ReplaceMe (Shopkhoev et al., 2025: a removed span becomes a least-squares map folded into the down projection before
it). Every step considers, for each remaining layer p, two actions on the current (already shortened) model:

- **drop** p;
- **replace** p: fit T on the layer before p (its MLP output M and pre-MLP residual Y, target the current model's state
  after p, least squares on float64 statistics) and fold it into that layer's down projection.

Each action is scored by the next-token NLL of the resulting model on the scored calibration batches, computed from
cached prefix states: the states entering every layer of the current model are kept, so an action at p only re-runs
the layers after p (and, for a replacement, the layer before p once to fit T). The cheapest action is taken.

Nothing touches the model during planning: a replaced layer is a private copy holding the folded map; `apply_` folds
the same maps into the real layers and drops the chosen ones. Layer 0 can only be dropped (no layer before it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import check_scoring_batches, mean_angle, next_token_nll
from ..config import MethodConfig
from ..ops.linear_map import fold_map_into_linear
from ..plan import LayerPlan
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import detached_copy
from ..utils.torch_utils import count_parameters
from .base import CompressionMethod, MethodContext, apply_layer_drop_
from .linear_bridge import fit_with_outputs, fold_into_down_, require_pre_norm
from .registry import register_method


@dataclass
class GreedyReplaceConfig(MethodConfig):
    """Options of the greedy drop-or-replace search.

    Attributes:
        scoring_batches: Score actions on the first this-many calibration batches (None: all); maps are always fitted
            on every batch. A step costs about L²/2 layer runs and 2L LM-head evaluations over the scored tokens.
        allow_drop: Consider plain drops besides replacements.
        shortlist: Score by NLL only the this-many actions whose state right after the action is closest (mean
            angle over the scored tokens) to the current model's state there; None scores every action. The
            pre-ranking needs no suffix run, so a step costs about one pass over the layers (the fits) plus
            `shortlist` suffix runs instead of L²/2 layer runs: on SmolLM2 the exhaustive search was still running
            after 40 CPU minutes.
    """

    scoring_batches: int | None = 1
    allow_drop: bool = True
    shortlist: int | None = None

    def __post_init__(self) -> None:
        check_scoring_batches(self.scoring_batches)
        if self.shortlist is not None and (
            not isinstance(self.shortlist, int) or isinstance(self.shortlist, bool) or self.shortlist < 1
        ):
            raise ValueError(f"shortlist must be a positive integer or None, got {self.shortlist!r}.")


@register_method("greedy_replace")
class GreedyReplaceMethod(CompressionMethod):
    config_class = GreedyReplaceConfig
    required_capabilities = frozenset({"layer_drop"})
    #: Its replacements are linear replacements already.
    accepts_linear_replacement = False
    config: GreedyReplaceConfig

    def __init__(self, config: GreedyReplaceConfig) -> None:
        super().__init__(config)
        self._maps: list[tuple[int, torch.Tensor]] = []
        self._head_weights = 0

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        require_pre_norm(adapter, stack, "method 'greedy_replace'")
        if adapter.lm_head(stack) is None:
            raise UnsupportedArchitectureError(
                f"method 'greedy_replace' scores actions by next-token loss, and this {type(adapter.model).__name__} "
                f"has no LM head reading the {stack!r} stack; use replaceme or uidl."
            )

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        runner = context.new_runner(adapter)
        layers = list(adapter.layers(context.stack))
        num_layers = len(layers)
        limit = self.config.scoring_batches or runner.num_batches
        scored = list(context.batches)[:limit]
        self._head_weights = count_parameters(adapter.lm_head(context.stack))  # the work of one head row
        modules: dict[int, torch.nn.Module] = {}  # private copies of layers that received a map
        kept = list(range(num_layers))
        steps: list[dict[str, Any]] = []
        self._maps = []
        with context.timer("selection"), context.progress_bar(num_to_remove, "greedy_replace") as bar:
            for step in range(num_to_remove):
                states = [runner.inputs]  # states entering kept[j], on every batch
                for index in kept:
                    states.append(runner.run(modules.get(index, layers[index]), index, states[-1]))
                best: tuple[float, str, int, Any] | None = None
                shortlisted: list[dict[str, Any]] = []
                for action, position, index, candidate_map, start in self._actions(
                    adapter, runner, layers, modules, kept, states, limit
                ):
                    if self.config.shortlist is None:
                        nll = self._score(adapter, runner, layers, modules, kept, position, start, scored, context)
                        if best is None or nll < best[0]:
                            best = (nll, action, index, candidate_map)
                        continue
                    # Pre-rank by the action's state at the boundary after it against the current model's state
                    # there; only the `shortlist` closest (their states alone are kept) get the full suffix run.
                    gap = mean_angle(start, states[position + 1][:limit], runner.masks[:limit])
                    shortlisted.append(
                        dict(gap=gap, action=action, position=position, index=index, map=candidate_map, start=start)
                    )
                    shortlisted = sorted(shortlisted, key=lambda c: (c["gap"], c["index"]))[: self.config.shortlist]
                if self.config.shortlist is not None:
                    for c in shortlisted:
                        nll = self._score(
                            adapter, runner, layers, modules, kept, c["position"], c.pop("start"), scored, context
                        )
                        if best is None or nll < best[0]:
                            best = (nll, c["action"], c["index"], c["map"])
                assert best is not None
                nll, action, index, transform = best
                position = kept.index(index)
                if action == "replace":
                    previous = kept[position - 1]
                    # A private, in-memory copy (offloaded layers too): the model is not touched while planning.
                    module = detached_copy(
                        modules.get(previous, layers[previous]), memo={id(adapter.config): adapter.config}
                    )
                    _fold_(adapter, module, previous, transform)
                    modules[previous] = module
                    self._maps.append((previous, transform))
                kept.remove(index)
                steps.append(
                    {"action": action, "layer": index, "nll": round(nll, 6)}
                    | ({"shortlist": [f"{c['action']} {c['index']}" for c in shortlisted]} if shortlisted else {})
                )
                bar.set_description(f"step {step + 1}/{num_to_remove}: {action} layer {index}")
                bar.update()
        context.report["greedy_replace_steps"] = steps
        return LayerPlan.from_kept(num_layers, kept, stack=context.stack)

    def _actions(
        self,
        adapter: ArchitectureAdapter,
        runner: Any,
        layers: list[torch.nn.Module],
        modules: dict[int, torch.nn.Module],
        kept: list[int],
        states: list[list[torch.Tensor]],
        limit: int,
    ) -> Iterator[tuple[str, int, int, torch.Tensor | None, list[torch.Tensor]]]:
        """Every action on the current model: (action, position in `kept`, layer, map or None, state after it)."""
        for position, index in enumerate(kept):
            if self.config.allow_drop or position == 0:
                yield "drop", position, index, None, states[position][:limit]
            if position > 0:
                previous = kept[position - 1]
                module = modules.get(previous, layers[previous])
                transform, start = fit_with_outputs(
                    adapter, runner, module, previous, states[position - 1], states[position + 1], limit
                )
                yield "replace", position, index, transform, start

    def _score(
        self,
        adapter: ArchitectureAdapter,
        runner: Any,
        layers: list[torch.nn.Module],
        modules: dict[int, torch.nn.Module],
        kept: list[int],
        position: int,
        start: list[torch.Tensor],
        scored: list[Any],
        context: MethodContext,
    ) -> float:
        """Next-token NLL of the model with the action taken: the layers after it run from `start`."""
        current = start
        for later in kept[position + 1 :]:
            current = runner.run(modules.get(later, layers[later]), later, current)
        context.extra_work += self._head_weights * sum(int(h.shape[0] * h.shape[1]) for h in current)
        return next_token_nll(adapter, current, scored, context.stack)

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        for index, transform in self._maps:
            fold_into_down_(adapter, plan.stack, index, transform)
        context.report["greedy_replace_maps"] = [index for index, _ in self._maps]
        apply_layer_drop_(adapter, plan)


def _fold_(adapter: ArchitectureAdapter, module: torch.nn.Module, position: int, transform: torch.Tensor) -> None:
    down = adapter.block_view(module, position).mlp.down
    weight, bias = fold_map_into_linear(down.weight, down.bias, transform.to(down.weight.device))
    down.set_(weight, bias)
