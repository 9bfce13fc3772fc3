"""FlattenGPT's groups chosen by calibration loss (``selection="loss"`` and ``"wide_loss"``; not in the paper).

The paper merges the adjacent pair whose layer inputs are most alike (cosine similarity). The quality issue's
ablation showed where that costs on Qwen2.5-0.5B: the chosen pairs, run in parallel and not pruned at all (the best
the pruning could do), already lose to SLEB's dropped layers on the out-of-domain text (benchmarks/NOTEBOOK.md). So
these selections score each candidate merge by the next-token NLL of the whole stack with the candidate's block in
place of its members, on the first calibration batches: greedy like the paper's Algorithm 1 (one merge per step,
groups up to `max_group_size`), with SLEB's criterion in place of the similarity. The block is the method's choice
(`candidate_block`): with ``"loss"`` the group compressed as FlattenGPT compresses it (the model the plan would
give, group by group), with ``"wide_loss"`` its wide block before pruning (norms folded, heads and channels side by
side: the members in parallel on one input).

Cost: the states entering every group of the current stack are kept on the scored batches; a candidate at position
p runs its block and the groups after it from there (a step with G groups: about G²/2 group runs and G − 1 LM heads
on the scored tokens). The merged groups' blocks are held until the plan is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.states import CalibratedStates
from ...compression.method import MethodContext
from ...ops.selection import max_merges
from ...plan import LayerPlan
from ...utils.offload import dispatch_like
from ...utils.torch_utils import count_parameters

Group = tuple[int, ...]


@torch.no_grad()
def groups_by_calibration_loss(
    adapter: ArchitectureAdapter,
    context: MethodContext,
    num_to_remove: int,
    max_group_size: int | None,
    scoring_batches: int | None,
    candidate_block: Callable[[Group], nn.Module],
) -> tuple[list[Group], list[dict[str, Any]]]:
    """Greedy adjacent merges, each the one whose block leaves the lowest calibration NLL.

    Args:
        adapter: The model's adapter (its layers are read, never changed).
        context: The method context (calibration batches, stack, timers, work counters).
        num_to_remove: Merges to make; each removes one layer.
        max_group_size: Largest group (None: unlimited).
        scoring_batches: Score on the first this-many calibration batches (None: all).
        candidate_block: The block that replaces a group of original layer indices (built or looked up).

    Returns:
        The groups covering 0..L-1 in order, and one record per step (the merge made, its NLL, and the runner-up).

    Raises:
        ValueError: when `num_to_remove` merges cannot be made within `max_group_size` (checked before every
            merge, so the search never takes a merge that would strand it).
    """
    runner = context.new_runner(adapter)
    states = CalibratedStates.on_first_batches(runner, adapter.layers(context.stack), context.batches, scoring_batches)
    num_layers = states.num_layers
    limit = max_group_size if max_group_size is not None else num_layers
    head_weights = count_parameters(adapter.lm_head(context.stack))
    groups: list[Group] = [(i,) for i in range(num_layers)]
    one_kind = adapter.layer_kind_rule(context.stack)
    blocks: dict[Group, nn.Module] = {}  # the blocks of the groups merged so far (candidate_block's)

    def run_group(group: Group, hidden: list[torch.Tensor], block: nn.Module | None = None) -> list[torch.Tensor]:
        # A group runs as the layer at its first member's position, with that layer's call arguments.
        module = block if block is not None else blocks.get(group)
        return states.run_layers([group[0]], hidden, {group[0]: module} if module is not None else None)

    def score(final: list[torch.Tensor]) -> float:
        context.extra_work += head_weights * sum(int(h.shape[0] * h.shape[1]) for h in final)
        return states.next_token_nll(adapter, final, context.stack)

    with context.timer("selection"):
        bounds = [states.boundary(0)]  # bounds[g]: the states entering group g of the current stack
        for group in groups:
            bounds.append(run_group(group, bounds[-1]))
    steps: list[dict[str, Any]] = []
    with context.timer("selection"), context.progress_bar(num_to_remove, "flattengpt loss selection") as bar:
        for step in range(num_to_remove):
            remaining = num_to_remove - step - 1
            # Only the best candidate's block is kept while the others are scored: one wide block at a time.
            best: tuple[float, int, nn.Module] | None = None
            runner_up: tuple[float, int] | None = None
            for g in range(len(groups) - 1):
                merged = groups[g] + groups[g + 1]
                # A merge that leaves too few admissible merges for the target is not a candidate (with pairs,
                # merging [1, 2] and [3, 4] of six layers would leave nothing to merge a third time).
                # Nor is a merge across layer kinds (sliding and full attention, NoPE), which no merged block can be.
                if not one_kind(merged) or len(merged) > limit:
                    continue
                if max_merges([*groups[:g], merged, *groups[g + 2 :]], limit, one_kind) < remaining:
                    continue
                block = candidate_block(merged)
                current = run_group(merged, bounds[g], block)
                for later in groups[g + 2 :]:
                    current = run_group(later, current)
                nll = score(current)
                del current
                # Lowest NLL; ties to the lower position, as the similarity selection breaks them.
                if best is None or nll < best[0]:
                    runner_up = None if best is None else (best[0], best[1])
                    best = (nll, g, block)
                elif runner_up is None or nll < runner_up[0]:
                    runner_up = (nll, g)
                del block
            if best is None:
                possible = max_merges(groups, limit, one_kind)
                raise ValueError(_STRANDED.format(num_to_remove, max_group_size, num_layers, possible, step))
            nll, g, block = best
            best = None
            merged = groups[g] + groups[g + 1]
            record: dict[str, Any] = {"merged": list(merged), "nll": round(nll, 6)}
            if runner_up is not None:
                record["runner_up"] = {
                    "merged": list(groups[runner_up[1]] + groups[runner_up[1] + 1]),
                    "nll": round(runner_up[0], 6),
                }
            for old in (groups[g], groups[g + 1]):
                blocks.pop(old, None)
            blocks[merged] = block
            groups[g : g + 2] = [merged]
            # The states below the merge are unchanged; those from it on are recomputed once.
            bounds = bounds[: g + 1]
            for group in groups[g:]:
                bounds.append(run_group(group, bounds[-1]))
            steps.append(record)
            bar.set_description(f"step {step + 1}/{num_to_remove}: merged {list(merged)}")
            bar.update()
    return groups, steps


#: The refusal when no admissible merge is left (the feasibility check makes it the target's, not the search's).
_STRANDED = (
    "{} merges cannot be made within max_group_size={} and one layer kind in a stack of {} layers (at most {} after "
    "{}); raise max_group_size or remove fewer layers."
)


def install_prebuilt_(
    adapter: ArchitectureAdapter,
    plan: LayerPlan,
    context: MethodContext,
    blocks: dict[tuple[int, ...], tuple[nn.Module, dict[str, Any]]],
) -> None:
    """The loss selection's compressed groups, built while planning, take their first members' places."""
    layers = adapter.layers(context.stack)
    missing = [list(g.indices) for g in plan.groups if not g.is_keep and g.indices not in blocks]
    if missing:  # before any layer is replaced
        raise ValueError(f"groups {missing} were not among the groups the selection compressed.")
    group_reports = []
    for group in plan.groups:
        if group.is_keep:
            continue
        block, group_report = blocks.pop(group.indices)
        adapter.replace_block_(context.stack, group.indices[0], dispatch_like(block, layers[group.indices[0]]))
        group_reports.append(group_report)
    adapter.keep_layers_(context.stack, plan.first_indices)
    context.report["groups"] = group_reports
