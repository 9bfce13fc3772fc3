"""ShortGPT (Men et al., 2024): drop the layers with the lowest Block Influence.

BI_i = 1 − E_tokens cos(h_i, h_{i+1}), where h_i enters layer i and h_{i+1} leaves it, measured on the residual
stream before the final norm for every layer including the last, padding masked.

``iterative=True`` is Prune&Comp's loop (Chen et al., AAAI 2026, arXiv 2507.18212, Algorithm 1): drop the one layer
with the lowest BI, and with ``compensation="scale"`` measure its α on the stream as already compensated, then
re-score the shortened (and compensated) model; repeat. Compensation scales the stream entering a later layer, so it
changes the later layers' BI: the re-scoring is what makes the loop differ from one pass. The compensated model is
walked virtually (a pre-norm layer run on α·x computes what the folded model computes, see compensation.py), so
nothing is folded until the end; each round costs one pass over the kept layers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..compression.method import CompressionMethod, MethodContext, apply_layer_drop_
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes, per_batch_term
from ..corrections.compensation import magnitude_ratio
from ..ops import top_k_indices
from ..options.methods.shortgpt import ShortGPTConfig
from ..plan import LayerPlan
from ..registry import register_method


def block_influence(adapter: ArchitectureAdapter, context: MethodContext) -> torch.Tensor:
    """(L,) float64 Block Influence of every layer of the stack, one layer-by-layer pass (two boundaries alive)."""
    states = context.new_states(adapter, keep=())
    scores = torch.zeros(states.num_layers, dtype=torch.float64)
    with context.timer("selection"), context.progress_bar(states.num_layers, "block influence") as bar:
        for i, before, after in states.walk():
            scores[i] = 1.0 - states.mean_cosine(before, after, tokens="all")
            bar.set_description(f"block {i + 1}/{states.num_layers}: block influence")
            bar.update()
    return scores


@torch.no_grad()
def iterative_plan(adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
    """One layer dropped per round on the model as shortened (and compensated) so far; α measured right after."""
    states = context.new_states(adapter, keep=())
    runner, layers = states.runner, states.layers
    compensate = context.compensation == "scale"
    dropped: dict[int, float] = {}  # layer -> α (1.0 without compensation), in drop order
    rounds: list[dict[str, Any]] = []
    with context.timer("selection"), context.progress_bar(num_to_remove, "iterative block influence") as bar:
        for _ in range(num_to_remove):
            current = runner.inputs
            scores: dict[int, float] = {}
            alphas: dict[int, float] = {}
            for i, layer in enumerate(layers):
                if i in dropped:
                    if dropped[i] != 1.0:
                        current = [h * dropped[i] for h in current]
                    continue
                output = runner.run(layer, i, current)
                scores[i] = 1.0 - states.mean_cosine(current, output, tokens="all")
                if compensate:
                    alphas[i] = magnitude_ratio(current, output, runner.masks)
                current = output
            worst = min(scores, key=lambda i: (scores[i], i))
            dropped[worst] = alphas.get(worst, 1.0)
            rounds.append(
                {"dropped": worst, "block_influence": {str(i): round(v, 6) for i, v in scores.items()}}
                | ({"alpha": dropped[worst]} if compensate else {})
            )
            bar.update()
    if compensate:
        context.measured_scales = dict(dropped)
    context.report["block_influence_rounds"] = rounds
    num_layers = len(layers)
    return LayerPlan.from_kept(num_layers, [i for i in range(num_layers) if i not in dropped], stack=context.stack)


@register_method("shortgpt")
class ShortGPTMethod(CompressionMethod):
    config_class = ShortGPTConfig
    requires_calibration = True
    required_capabilities = frozenset({"layer_drop"})
    #: Block Influence is a mean cosine over tokens: its sum and count are summed over the ranks.
    shards_calibration = True

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """ShortGPT: one walk over the stack, Block Influence = 1 − cos(input, output) per layer.

        - selection: the runner (S); the walk's previous boundary, which the caller's loop variable still holds, and its
          current one (2S); the boundary being computed (run); or, between runs, the float64 cosine of one batch
          (`cosine_rows` over every token: two float64 copies, their masked copies and a product, 40·T_b·d).
        Cost: one pass; ``iterative=True`` walks the kept layers once a round, L − k layers in round k, so
        Σ_{k<n} (L − k) / L passes (its α and its stream scaling hold no more than the walk's two boundaries).
        """
        selection = Phase(
            "selection",
            (
                z.tokens(),
                *z.runners(1),
                Term("the walk's two boundaries", 2 * z.S, "the input and output of the last layer run"),
                per_batch_term(z, 40 * z.Tb * z.d, "float64 cosine over every token"),
            ),
        )
        L = z.shape.num_layers
        passes = sum(L - k for k in range(n)) / L if config.iterative else 1.0
        return [selection], passes, False, []

    @classmethod
    def measures_compensation(cls, config: Any) -> bool:
        """The iterative loop measures each dropped layer's α as it drops it (`iterative_plan`)."""
        return bool(config.iterative)

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        if self.config.iterative:
            return iterative_plan(adapter, context, num_to_remove)
        scores = block_influence(adapter, context)
        num_layers = scores.numel()
        kept = top_k_indices(scores, num_layers - num_to_remove)
        context.report["block_influence"] = [round(float(s), 6) for s in scores]
        return LayerPlan(
            num_layers=num_layers,
            groups=[(i,) for i in kept],
            stack=context.stack,
            scores=[float(s) for s in scores],
        )

    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        apply_layer_drop_(adapter, plan)
