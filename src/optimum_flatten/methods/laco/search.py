"""The search over candidate merged stacks that LaCo introduced and Sliding-Window Merging shares.

A candidate stack is an ordered list of groups of original layer indices: a group of one is the original layer,
a larger group is those layers merged by parameters. The evaluator caches the original model's input to every
layer once, so a candidate that first differs from the original at position p is run from the cached state of
p onwards: the prefix is never recomputed. Memory: (L + 1) copies of the calibration states.
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.states import CalibratedStates
from ...compression.method import CardSection, CompressionMethod, MethodContext
from ...ops import MERGE_RULES
from ...ops.selection import max_merges
from ...plan import LayerPlan
from ...utils.offload import dispatch_like
from ...utils.torch_utils import count_parameters

logger = logging.getLogger(__name__)

Group = tuple[int, ...]

#: Rise of the mean next-token loss on the calibration text (merged model minus original, nats per token) past
#: which the merged model is flagged: ln 2, i.e. its calibration perplexity more than doubled. Depth compression
#: of this size usually costs less on the text it was calibrated on (FlattenGPT, ShortGPT and SLEB removing 6 of
#: SmolLM2's 30 layers raise held-out perplexity 1.9-2.2x); a similarity threshold searched down to whatever reaches
#: the target has produced perplexities of 10^6 and more, a model that only emits gibberish.
NLL_RISE_BOUND = math.log(2)


class StackEvaluator:
    """Runs candidate stacks on the calibration batches and compares them with the original model.

    The states, the candidate runs, the cosine and the next-token loss are the states engine's (`engine`): the
    evaluator adds only what a search over merged stacks needs (merged blocks, memoised scores, the trace).
    """

    def __init__(
        self,
        adapter: ArchitectureAdapter,
        context: MethodContext,
        merge_rule: str = "differences",
        num_batches: int | None = None,
    ) -> None:
        if merge_rule not in MERGE_RULES:
            raise ValueError(f"merge_rule must be one of {sorted(MERGE_RULES)}, got {merge_rule!r}.")
        self.adapter = adapter
        self.context = context
        self.merge = MERGE_RULES[merge_rule]
        # Score on the first batches only: the search runs many candidates, each above its window.
        self.engine = CalibratedStates.on_first_batches(
            context.new_runner(adapter), adapter.layers(context.stack), context.batches, num_batches
        )
        self.runner = self.engine.runner
        self.layers = self.engine.layers
        self.masks = self.engine.masks
        self._one_kind = adapter.layer_kind_rule(context.stack)
        self._merged_cache: dict[Group, nn.Module] = {}
        self._scores: dict[tuple[str, tuple[Group, ...]], float] = {}
        #: Every (candidate, score) asked for, in order (repeats included): what a refusal reports on.
        self.trace: list[tuple[tuple[Group, ...], float]] = []
        with context.timer("selection"):
            #: states[i] enters original layer i; states[L] leaves the last layer (before the final norm).
            self.states = self.engine.all_boundaries()
        self.reference = self.finish(self.states[-1])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def one_kind(self, stack: Sequence[Group], start: int, stop: int) -> bool:
        """Whether the groups at positions start..stop may merge: layers the config describes alike (sliding and
        full attention, NoPE layers never share a merged block); a window that mixes them is not a candidate."""
        return self._one_kind(merge_positions(stack, start, stop)[start])

    def block(self, group: Group) -> nn.Module:
        """The module for a group: the original layer, or the members merged by parameters (cached)."""
        if len(group) == 1:
            return self.layers[group[0]]
        if group not in self._merged_cache:
            state = self.merge([self.adapter.mergeable_state(self.layers[i]) for i in group])
            self._merged_cache[group] = self.adapter.build_merged_block(self.context.stack, group[0], state)
        return self._merged_cache[group]

    def run(self, stack: Sequence[Group]) -> list[torch.Tensor]:
        """Final-norm states of a candidate stack, reusing the cached original prefix."""
        return self.finish(self.run_stack(stack))

    def run_stack(self, stack: Sequence[Group]) -> list[torch.Tensor]:
        """States leaving the last block of a candidate stack (before the final norm), from the cached prefix."""
        start = 0
        while start < len(stack) and stack[start] == (start,):
            start += 1
        suffix = stack[start:]
        with self.context.timer("selection"):
            # A group runs as the layer at its first member's position, with that layer's call arguments.
            blocks = {group[0]: self.block(group) for group in suffix if len(group) > 1}
            current = self.engine.run_layers([group[0] for group in suffix], self.states[start], blocks)
        # Keep only the merged blocks this stack uses: the accepted ones are reused by the next candidates, the
        # rejected ones would otherwise pile up one layer each.
        used = set(stack)
        self._merged_cache = {g: m for g, m in self._merged_cache.items() if g in used}
        return current

    def finish(self, states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = self.adapter.final_norm(self.context.stack)
        with torch.no_grad():
            return [norm(h) if norm is not None else h for h in states]

    def cosine_to_reference(self, states: Sequence[torch.Tensor]) -> float:
        """Masked mean token cosine similarity between a candidate's final states and the original model's."""
        return self.engine.mean_cosine(states, self.reference, tokens="all")

    def cka_to_reference(self, states: Sequence[torch.Tensor]) -> float:
        """Linear CKA between the candidate's and the original's final token representations (masked)."""
        x = torch.cat([h[m.bool()] for h, m in zip(states, self.masks, strict=True)]).double()
        y = torch.cat([h[m.bool()] for h, m in zip(self.reference, self.masks, strict=True)]).double()
        x = x - x.mean(dim=0)
        y = y - y.mean(dim=0)
        cross = (x.T @ y).norm() ** 2
        return float(cross / ((x.T @ x).norm() * (y.T @ y).norm()))

    def score(self, stack: Sequence[Group], kind: str = "cosine") -> float:
        """Similarity of a candidate stack to the original model, memoised: a threshold search revisits stacks."""
        key = (kind, tuple(stack))
        if key not in self._scores:
            if kind == "cosine":
                self._scores[key] = self.cosine_to_reference(self.run(stack))
            elif kind == "cka":
                self._scores[key] = self.cka_to_reference(self.run(stack))
            else:
                raise ValueError(f"similarity must be 'cosine' or 'cka', got {kind!r}.")
        self.trace.append((tuple(stack), self._scores[key]))
        return self._scores[key]


def identity_stack(num_layers: int) -> list[Group]:
    return [(i,) for i in range(num_layers)]


def merge_positions(stack: Sequence[Group], start: int, stop: int) -> list[Group]:
    """The stack with its groups at positions start..stop (inclusive) merged into one."""
    merged = tuple(i for group in stack[start : stop + 1] for i in group)
    return [*stack[:start], merged, *stack[stop + 1 :]]


def check_layer_range(num_layers: int, min_layer: int, max_layer: int | None, num_to_remove: int) -> int:
    """Validates a protected range [min_layer, max_layer] (0-based, inclusive) and returns max_layer.

    Raises:
        ValueError: when the range is empty or cannot lose `num_to_remove` layers by merging within it.
    """
    top = num_layers - 1 if max_layer is None else max_layer
    if not 0 <= min_layer <= top < num_layers:
        raise ValueError(
            f"layer range [min_layer={min_layer}, max_layer={max_layer}] is not within 0..{num_layers - 1}."
        )
    removable = top - min_layer
    if num_to_remove > removable:
        raise ValueError(
            f"the layer range [{min_layer}, {top}] holds {removable + 1} layers, so merging within it can remove "
            f"at most {removable}, fewer than the {num_to_remove} requested. Widen min_layer/max_layer or remove fewer."
        )
    return top


def search_threshold(
    run: Callable[[float], list[Group] | None], low: float = 0.0, high: float = 1.0, steps: int = 12
) -> tuple[float, list[Group]]:
    """Bisects the highest threshold for which `run(threshold)` reaches the target (returns a stack, not None)."""
    best = run(low)
    if best is None:
        raise ValueError("no threshold reaches the requested number of removed layers, even 0; widen the layer range.")
    best_threshold = low
    for _ in range(steps):
        middle = (low + high) / 2
        stack = run(middle)
        if stack is None:
            high = middle
        else:
            low, best, best_threshold = middle, stack, middle
    return best_threshold, best


def apply_parameter_merge_(adapter: ArchitectureAdapter, plan: Any, merge_rule: str) -> None:
    """Applies a plan whose groups merge layers by parameters, computed from the unmodified layers."""
    merge = MERGE_RULES[merge_rule]
    layers = adapter.layers(plan.stack)
    merged = {}
    for group in plan.merged_groups:
        state = merge([adapter.mergeable_state(layers[i]) for i in group])
        block = adapter.build_merged_block(plan.stack, group[0], state)
        del state
        # Offloaded again right away if the layer it replaces was: peak memory stays at one merged block.
        merged[group[0]] = dispatch_like(block, layers[group[0]])
    for first, block in merged.items():
        adapter.replace_block_(plan.stack, first, block)
    adapter.keep_layers_(plan.stack, plan.first_indices)


def stack_for_threshold(
    run: Callable[[float], list[Group] | None],
    threshold: float | None,
    method: str,
    num_to_remove: int,
    search_steps: int = 12,
    explain: Callable[[float], str] | None = None,
) -> tuple[float, list[Group]]:
    """The stack for a fixed threshold, or, with None, for the highest threshold that reaches the target.

    Args:
        explain: Called with a fixed threshold that falls short; returns what the refusal adds after its first
            clause (how close the search came, what to lower). The refusal never suggests ``threshold=None``: the
            highest threshold that reaches the target can be one that ruins the model.

    Raises:
        ValueError: when a fixed threshold does not reach `num_to_remove` removed layers.
    """
    if threshold is None:
        return search_threshold(run, steps=search_steps)
    stack = run(threshold)
    if stack is None:
        detail = explain(threshold) if explain is not None else "lower the threshold, or remove fewer layers"
        raise ValueError(f"{method} could not remove {num_to_remove} layers at threshold={threshold}: {detail}")
    return threshold, stack


class ParameterMergeMethod(CompressionMethod):
    """Template of the methods that search merged stacks above a threshold (LaCo, Sliding-Window Merging).

    Subclasses implement `search(evaluator, threshold, target, top)`, returning the stack reached at that
    threshold (fewer than `target` layers removed when it falls short), and use `accepts` to compare a score with
    the threshold; the config provides `threshold`, `min_layer`, `max_layer`, `merge_rule`, `search_steps`,
    `scoring_batches` and optionally `similarity`.

    Besides the plan, the report gets the threshold used, the final similarity and ``calibration_loss``: the mean
    next-token loss of the original and the merged stack on the scored calibration batches, and a warning when it
    rose by more than `NLL_RISE_BOUND`. Similarity of final states is what the papers threshold, but it says little
    about the loss: a searched threshold has reached the target with a model whose perplexity was 10^6.
    """

    merges_layers = True

    #: Parameter differences θ_l + Σ_k (θ_{l+k} − θ_l) stand for the summed updates only where each block adds its
    #: sublayers' outputs to the stream unnormalised and their parameters correspond one to one across layers.
    required_capabilities = frozenset({"layer_drop", "parameter_merge"})

    @abstractmethod
    def search(self, evaluator: StackEvaluator, threshold: float, target: int, top: int) -> list[Group]:
        """The stack reached at `threshold` (fewer than `target` layers removed when it falls short)."""

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """The calibration-loss warning, when the merged stack's loss rose past `NLL_RISE_BOUND`."""
        warning = (report.get("calibration_loss") or {}).get("warning")
        return CardSection(lines=(f"- Warning: {warning}",), warnings=(warning,)) if warning else None

    def accepts(self, score: float, threshold: float) -> bool:
        """Whether a candidate with similarity `score` passes `threshold` (at least it; LaCo: strictly above)."""
        return score >= threshold

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        """The protected range, and within it the layer kinds (`one_kind`: a window never joins sliding and full
        attention, or a layer without rotary positions), bound what merging can remove (`ops.max_merges`): a target
        past that is refused before calibrating, where the search would score every window first."""
        top = check_layer_range(num_layers, self.config.min_layer, self.config.max_layer, num_to_remove)
        layers = [(i,) for i in range(self.config.min_layer, top + 1)]
        possible = max_merges(layers, len(layers), one_kind)
        if num_to_remove > possible:
            raise ValueError(
                f"{self.name} merges windows of adjacent layers of one kind (sliding and full attention, or layers "
                f"without rotary positions, are never merged), and the layer range [{self.config.min_layer}, {top}] "
                f"can lose at most {possible} that way, fewer than the {num_to_remove} requested. Remove fewer layers, "
                "or widen min_layer/max_layer."
            )

    def shortfall_hints(self) -> list[str]:
        """Method options whose lowering helps a fixed threshold reach the target, for the refusal (none here)."""
        return []

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        num_layers = adapter.num_layers(context.stack)
        top = check_layer_range(num_layers, self.config.min_layer, self.config.max_layer, num_to_remove)
        evaluator = StackEvaluator(adapter, context, self.config.merge_rule, self.config.scoring_batches)
        reached: dict[float, tuple[list[Group], int]] = {}

        def run(threshold: float) -> list[Group] | None:
            start = len(evaluator.trace)
            stack = self.search(evaluator, threshold, num_to_remove, top)
            reached[threshold] = (stack, start)
            return stack if num_layers - len(stack) == num_to_remove else None

        def explain(threshold: float) -> str:
            stack, start = reached[threshold]
            return self._shortfall(evaluator, threshold, stack, evaluator.trace[start:])

        threshold, stack = stack_for_threshold(
            run, self.config.threshold, self.name, num_to_remove, self.config.search_steps, explain
        )
        context.report["threshold"] = threshold
        context.report["threshold_searched"] = self.config.threshold is None
        context.report["final_similarity"] = evaluator.score(stack, self._similarity)
        loss = self._calibration_loss(adapter, context, evaluator, stack, threshold, num_to_remove)
        if loss is not None:
            context.report["calibration_loss"] = loss
        return LayerPlan(
            num_layers=num_layers, groups=stack, rule=f"param_{self.config.merge_rule}", stack=context.stack
        )

    @property
    def _similarity(self) -> str:
        return getattr(self.config, "similarity", "cosine")

    def _shortfall(
        self,
        evaluator: StackEvaluator,
        threshold: float,
        reached: Sequence[Group],
        trace: Sequence[tuple[tuple[Group, ...], float]],
    ) -> str:
        """Why a fixed threshold fell short: how many layers it removed, how close the best refused window came, and
        what to lower. A lower threshold is offered only down to that window's own similarity, never as a search:
        the threshold that reaches any target can be one that ruins the model."""
        removed = evaluator.num_layers - len(reached)
        kind = "linear CKA" if self._similarity == "cka" else "cosine similarity"
        parts = [f"it removed {removed}" + (f" (merged {[list(g) for g in reached if len(g) > 1]})" if removed else "")]
        refused = [(stack, score) for stack, score in trace if not self.accepts(score, threshold)]
        lower = []
        if refused:
            stack, score = max(refused, key=lambda item: item[1])
            window = next((g for g in stack if len(g) > 1 and g not in reached), None)
            where = f"merging layers {window[0]}-{window[-1]}" if window else "the closest candidate"
            parts.append(
                f"the closest refused window ({where}) reached a {kind} of {score:.4f} to the original model's final "
                f"states, {threshold - score:.4f} short"
            )
            suggestion = math.floor(score * 1000 - 1e-9) / 1000  # strictly below: LaCo accepts only above
            if suggestion > 0:
                lower.append(
                    f"threshold to {suggestion:.3f} (just below that window's {score:.4f}; every step down keeps a "
                    "model less like the original, so measure its perplexity)"
                )
        else:
            top = evaluator.num_layers - 1 if self.config.max_layer is None else self.config.max_layer
            parts.append(f"no window was refused: the layer range [{self.config.min_layer}, {top}] ran out")
        if removed:
            lower.append(f"num_layers_to_remove to {removed} (reached at this threshold)")
        else:
            lower.append("num_layers_to_remove")
        lower += self.shortfall_hints()
        return "; ".join(parts) + ". Lower " + ", or ".join(lower) + "."

    def _calibration_loss(
        self,
        adapter: ArchitectureAdapter,
        context: MethodContext,
        evaluator: StackEvaluator,
        stack: Sequence[Group],
        threshold: float,
        num_to_remove: int,
    ) -> dict[str, Any] | None:
        """Mean next-token loss of the original and the merged stack on the scored calibration batches (None for a
        stack without an LM head), with a warning past `NLL_RISE_BOUND`; costs two LM-head passes over them."""
        head = adapter.lm_head(context.stack)
        if head is None:
            return None
        engine = evaluator.engine
        with context.timer("selection"):
            dense = engine.next_token_nll(adapter, evaluator.states[-1], context.stack)
            merged_states = evaluator.run_stack(stack)
            merged = engine.next_token_nll(adapter, merged_states, context.stack)
        tokens = sum(int(h.shape[0] * h.shape[1]) for h in merged_states)
        context.extra_work += 2 * count_parameters(head) * tokens
        rise = merged - dense
        loss: dict[str, Any] = {
            "dense_nll": round(dense, 6),
            "merged_nll": round(merged, 6),
            "rise": round(rise, 6),
            "perplexity_ratio": math.exp(rise) if rise < 700 else math.inf,
            "bound": round(NLL_RISE_BOUND, 6),
            "batches": engine.num_batches,
        }
        if rise > NLL_RISE_BOUND:
            searched = (
                f" threshold={threshold:.4f} was searched as the highest that removes {num_to_remove} layers."
                if self.config.threshold is None
                else ""
            )
            loss["warning"] = (
                f"{self.name}: the merged model's mean next-token loss on the calibration text rose from {dense:.3f} "
                f"to {merged:.3f} nats per token (perplexity x{loss['perplexity_ratio']:.3g}), past the bound of "
                f"ln 2 (perplexity doubled).{searched} Remove fewer layers or set a higher threshold, and measure "
                "held-out perplexity before using this model."
            )
            logger.warning("%s", loss["warning"])
        return loss

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        apply_parameter_merge_(adapter, plan, self.config.merge_rule)
