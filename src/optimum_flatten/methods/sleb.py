"""SLEB (Song et al., 2024, "SLEB: Streamlining LLMs through Redundancy Verification and Elimination of Blocks").

Iterative: at each step remove the single layer whose removal raises the calibration negative log-likelihood
the least, then re-score the shortened model. The states entering every layer of the current model are computed
once per step; a candidate removal at position p re-runs only the layers above p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..calibration.states import CalibratedStates, check_scoring_batches, next_token_nll
from ..config import LayerPlan, MethodConfig
from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import count_parameters
from .base import CompressionMethod, MethodContext, apply_layer_drop_
from .registry import register_method


@dataclass
class SLEBConfig(MethodConfig):
    """Options of SLEB.

    Attributes:
        protect_first: Never remove the first layer.
        protect_last: Never remove the last layer.
        scoring_batches: Score removals on the first this-many calibration batches only (None: all); the cost of
            a step is about L²/2 layer runs plus L LM-head evaluations over the scored tokens.
    """

    protect_first: bool = False
    protect_last: bool = False
    scoring_batches: int | None = None

    def __post_init__(self) -> None:
        check_scoring_batches(self.scoring_batches)


#: Kept under its old name: the row-bounded next-token loss now lives in the states engine.
calibration_nll = next_token_nll


@register_method("sleb")
class SLEBMethod(CompressionMethod):
    config_class = SLEBConfig
    requires_calibration = True
    required_capabilities = frozenset({"layer_drop"})
    config: SLEBConfig

    def plan(self, adapter: Any, context: MethodContext, num_to_remove: int) -> LayerPlan:
        if adapter.lm_head(context.stack) is None:
            raise UnsupportedArchitectureError(
                f"method 'sleb' scores layer removals by the next-token negative log-likelihood of a causal LM head "
                f"reading the {context.stack!r} stack, and this {type(adapter.model).__name__} has none there "
                "(lm_head() is None). Methods that compare the stack's own states apply: shortgpt, laco, "
                "sliding_window (and flattengpt on pre-norm stacks)."
            )
        num_layers = adapter.num_layers(context.stack)
        protected = {0} if self.config.protect_first else set()
        if self.config.protect_last:
            protected.add(num_layers - 1)
        if num_layers - len(protected) < num_to_remove:
            raise ValueError(
                f"with protected layers {sorted(protected)} only {num_layers - len(protected)} layers can be "
                f"removed, fewer than the {num_to_remove} requested."
            )
        # Only the input of layer 0 is cached: after the first removal the stack differs from the original one,
        # so each step computes the boundaries of its own current stack.
        states = CalibratedStates.on_first_batches(
            context.new_runner(adapter),
            adapter.layers(context.stack),
            context.batches,
            self.config.scoring_batches,
            keep=(),
        )
        head_weights = count_parameters(adapter.lm_head(context.stack))
        kept = list(range(num_layers))
        history = []
        with context.timer("selection"), context.progress_bar(num_to_remove, "sleb") as bar:
            for step in range(num_to_remove):
                boundaries = [states.boundary(0)]
                for index in kept:
                    boundaries.append(states.run_layers([index], boundaries[-1]))
                scores = {}
                for position, index in enumerate(kept):
                    if index in protected:
                        continue
                    current = states.run_layers(kept[position + 1 :], boundaries[position])
                    scores[index] = calibration_nll(adapter, current, states.batches, context.stack)
                    context.extra_work += head_weights * sum(int(h.shape[0] * h.shape[1]) for h in current)
                removed = min(scores, key=lambda i: (scores[i], i))
                history.append({"removed": removed, "nll": scores[removed], "scores": scores})
                kept.remove(removed)
                bar.set_description(f"step {step + 1}/{num_to_remove}: removed layer {removed}")
                bar.update()
        context.report["sleb_steps"] = [{"removed": h["removed"], "nll": round(h["nll"], 6)} for h in history]
        return LayerPlan.from_kept(num_layers, kept, stack=context.stack)

    def apply_(self, adapter: Any, plan: LayerPlan, context: MethodContext) -> None:
        apply_layer_drop_(adapter, plan)
