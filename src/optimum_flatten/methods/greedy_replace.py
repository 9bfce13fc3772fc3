"""``method="greedy_replace"``: one layer at a time, drop it or replace it by a fitted map, whichever costs least.

A hybrid of SLEB (Song et al., 2024: remove the layer whose removal raises the calibration NLL least, re-score) and
ReplaceMe (Shopkhoev et al., 2025: a removed span becomes a least-squares map folded into the down projection before
it). Every step considers, for each remaining layer p, two actions on the current (already shortened) model:

- **drop** p;
- **replace** p: fit T on the layer before p (its MLP output M and pre-MLP residual Y, target the current model's state
  after p, least squares on float64 statistics) and fold it into that layer's down projection;
- **flatten** p with the next layer (`allow_flatten=True`, the quality issue's hybrid): when p and p + 1 are both
  still there and untouched, merge them as FlattenGPT merges a pair (one wide block pruned back to one layer's heads
  and channels, `FlattenGPTMethod.compress_group`, with its default options or `flatten_options`) on the current
  model's states entering p. A pair's block depends only on the layers before it, so it is built once and reused by
  the later steps until an action before it changes its input.

Each action is scored by the next-token NLL of the resulting model on the scored calibration batches, computed from
cached prefix states: the states entering every layer of the current model are kept, so an action at p only re-runs
the layers after p (and, for a replacement, the layer before p once to fit T). The cheapest action is taken.

Nothing touches the model during planning: a replaced layer is a private copy holding the folded map, a merged pair
a private block; `apply_` installs the merged blocks, folds the same maps into the real layers (a map chosen after a
merge may land in the merged block) and drops the chosen ones. Layer 0 can only be dropped or flattened (no layer
before it to hold a map).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..calibration.states import mean_angle, next_token_nll
from ..compression.method import LinearReplacementMethod, MethodContext
from ..corrections.bridge_fit import LayerRun, fit_with_outputs, fold_into_down_
from ..corrections.linear_bridge import require_bridgeable
from ..options.methods.greedy_replace import GreedyReplaceConfig
from ..plan import LayerPlan
from ..registry import register_method, require_capabilities
from ..utils.errors import UnsupportedArchitectureError
from ..utils.offload import detached_copy, dispatch_like
from ..utils.torch_utils import count_parameters
from .flattengpt import FlattenGPTMethod


@dataclass
class _Current:
    """The model as the search has changed it so far, without touching the real one: the layers still kept and the
    private copies (a folded map, a merged pair's block) standing in for some of them. Building every action and
    scoring it read the same model, so they take this one object."""

    adapter: ArchitectureAdapter
    runner: Any
    layers: list[torch.nn.Module]
    #: Private copies of layers that received a map, and merged blocks by their first member.
    modules: dict[int, torch.nn.Module]
    kept: list[int]
    context: MethodContext

    def layer(self, index: int) -> torch.nn.Module:
        """Original layer `index` as the current model runs it: its private copy where it has one."""
        return self.modules.get(index, self.layers[index])

    @functools.cached_property
    def one_kind(self) -> Callable[[Sequence[int]], bool]:
        """The stack's layer-kind rule (`ArchitectureAdapter.layer_kind_rule`), read once for the whole search."""
        return self.adapter.layer_kind_rule(self.context.stack)


@register_method("greedy_replace")
class GreedyReplaceMethod(LinearReplacementMethod):
    config_class = GreedyReplaceConfig
    config: GreedyReplaceConfig

    def __init__(self, config: GreedyReplaceConfig) -> None:
        super().__init__(config)
        self._maps: list[tuple[int, torch.Tensor]] = []
        self._merges: dict[int, torch.nn.Module] = {}  # first member -> the merged pair's block
        self._head_weights = 0

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        require_bridgeable(adapter, stack, "method 'greedy_replace'")
        if adapter.lm_head(stack) is None:
            raise UnsupportedArchitectureError(
                f"method 'greedy_replace' scores actions by next-token loss, and this {type(adapter.model).__name__} "
                f"has no LM head reading the {stack!r} stack; use replaceme or uidl."
            )
        if self.config.allow_flatten:
            require_capabilities(adapter, "flattengpt")

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        runner = context.new_runner(adapter)
        layers = list(adapter.layers(context.stack))
        num_layers = len(layers)
        limit = self.config.scoring_batches or runner.num_batches
        scored = list(context.batches)[:limit]
        self._head_weights = count_parameters(adapter.lm_head(context.stack))  # the work of one head row
        current = _Current(adapter, runner, layers, {}, list(range(num_layers)), context)
        modules, kept = current.modules, current.kept
        steps: list[dict[str, Any]] = []
        self._maps, self._merges = [], {}
        #: Merged pairs built so far, by first member: (block, its output on the scored batches); valid while no
        #: action before the pair changes its input.
        pairs: dict[int, tuple[torch.nn.Module, list[torch.Tensor]]] = {}
        with context.timer("selection"), context.progress_bar(num_to_remove, "greedy_replace") as bar:
            for step in range(num_to_remove):
                states = [runner.inputs]  # states entering kept[j], on every batch
                for index in kept:
                    states.append(runner.run(current.layer(index), index, states[-1]))
                best: tuple[float, str, int, Any] | None = None
                shortlisted: list[dict[str, Any]] = []
                for action, position, index, candidate_map, start in self._actions(current, states, limit, pairs):
                    if self.config.shortlist is None:
                        nll = self._score(current, position, start, scored)
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
                        nll = self._score(current, c["position"], c.pop("start"), scored)
                        if best is None or nll < best[0]:
                            best = (nll, c["action"], c["index"], c["map"])
                assert best is not None
                nll, action, index, transform = best
                position = kept.index(index)
                if action == "flatten":
                    first = kept[position - 1]
                    modules[first] = self._merges[first] = transform
                    changed = first
                elif action == "replace":
                    previous = kept[position - 1]
                    # A private, in-memory copy (offloaded layers too): the model is not touched while planning.
                    module = detached_copy(current.layer(previous), memo={id(adapter.config): adapter.config})
                    adapter.fold_after_mlp_(module, previous, transform)
                    modules[previous] = module
                    self._maps.append((previous, transform))
                    changed = previous
                else:
                    changed = index
                # A pair's block and output stay valid while everything before its first member is unchanged.
                pairs = {first: built for first, built in pairs.items() if first < changed}
                kept.remove(index)
                steps.append(
                    {"action": action, "layer": index, "nll": round(nll, 6)}
                    | ({"merged_with": kept[position - 1]} if action == "flatten" else {})
                    | ({"shortlist": [f"{c['action']} {c['index']}" for c in shortlisted]} if shortlisted else {})
                )
                bar.set_description(f"step {step + 1}/{num_to_remove}: {action} layer {index}")
                bar.update()
        context.report["greedy_replace_steps"] = steps
        groups = [[i, i + 1] if i in self._merges else [i] for i in kept]
        rule = "flatten_prune" if self._merges else "none"
        return LayerPlan(num_layers=num_layers, groups=groups, rule=rule, stack=context.stack)

    def _actions(
        self,
        current: _Current,
        states: list[list[torch.Tensor]],
        limit: int,
        pairs: dict[int, tuple[torch.nn.Module, list[torch.Tensor]]],
    ) -> Iterator[tuple[str, int, int, Any, list[torch.Tensor]]]:
        """Every action on the current model: (action, position in `kept` of the layer it removes, that layer, the
        map or merged block or None, the state after the action). A flatten removes the pair's second member."""
        adapter, runner, kept = current.adapter, current.runner, current.kept
        for position, index in enumerate(kept):
            if self.config.allow_drop or position == 0:
                yield "drop", position, index, None, states[position][:limit]
            if self._flattenable(current, position):
                if index not in pairs:
                    block, _, _ = FlattenGPTMethod(self.config.flatten_config()).compress_group(
                        adapter, runner, (index, index + 1), states[position], current.context
                    )
                    pairs[index] = (block, runner.run(block, index, states[position][:limit]))
                block, start = pairs[index]
                yield "flatten", position + 1, index + 1, block, start
            if position > 0:
                previous = kept[position - 1]
                module = current.layer(previous)
                run = LayerRun(adapter, runner, module, previous, states[position - 1], states[position + 1])
                transform, start = fit_with_outputs(run, limit)
                yield "replace", position, index, transform, start

    def _flattenable(self, current: _Current, position: int) -> bool:
        """The layer at `position` and the original layer after it are both kept, untouched (no map, no merge) and of
        one kind."""
        kept, modules = current.kept, current.modules
        if not self.config.allow_flatten or position + 1 >= len(kept):
            return False
        index = kept[position]
        untouched = kept[position + 1] == index + 1 and index not in modules and index + 1 not in modules
        # Layers of two kinds (sliding and full attention, NoPE) are never merged: the plan would be refused after the
        # whole search, which has no range option to steer it off the pair.
        return untouched and current.one_kind((index, index + 1))

    def _score(self, current: _Current, position: int, start: list[torch.Tensor], scored: list[Any]) -> float:
        """Next-token NLL of the model with the action taken: the layers after it run from `start`."""
        hidden = start
        for later in current.kept[position + 1 :]:
            hidden = current.runner.run(current.layer(later), later, hidden)
        current.context.extra_work += self._head_weights * sum(int(h.shape[0] * h.shape[1]) for h in hidden)
        return next_token_nll(current.adapter, hidden, scored, current.context.stack)

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        layers = adapter.layers(plan.stack)
        # Merged blocks first: a map chosen after a merge was fitted on, and folds into, the merged block.
        for first, block in self._merges.items():
            adapter.replace_block_(plan.stack, first, dispatch_like(block, layers[first]))
        for index, transform in self._maps:
            fold_into_down_(adapter, plan.stack, index, transform)
        context.report["greedy_replace_maps"] = [index for index, _ in self._maps]
        context.report["greedy_replace_merges"] = [[first, first + 1] for first in self._merges]
        self._merges = {}
        adapter.keep_layers_(plan.stack, plan.first_indices)
