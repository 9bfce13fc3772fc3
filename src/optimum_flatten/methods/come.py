"""CoMe (Wang et al., NeurIPS 2025, arXiv 2510.15304): progressive concatenation merging of adjacent layers.

Repeated until `num_layers_to_remove` merges are done, each time on the model as the merges so far left it:

1. Select: the adjacent pair (i, i+1) with the smallest angular distance arccos(cos(x_i, x_{i+2})) / π between the
   input of layer i and the output of layer i+1, on each sequence's last real token.
2. Share: layer i keeps BI_i / (BI_i + BI_{i+1}) of the KV groups (with their query heads) and of the MLP neurons,
   rounded to whole units so that the two shares sum to the original counts; BI = 1 − cos(input, output) over
   every real token (ShortGPT's Block Influence).
3. Score: a neuron by mean |activation entering W_down| × ‖W_down column‖₁; a KV group by the same score summed over
   the o_proj input channels of its query heads. Each layer keeps its own best neurons and groups.
4. Concatenate the kept parts into one layer of the original width (q/k/v rows and o_proj columns side by side,
   gate/up rows and down columns side by side), with each norm the mean of the two layers' norms. With
   ``fold_norms=True`` each layer's norm gains are folded exactly into its own projections instead and the merged
   norms have unit gain.

A merged layer may be merged again later (a chain), so a plan group can hold three or more original layers; the
order of the merges is in the report (``merges``). The merged blocks are built while planning, because each choice
is measured on the model the previous merges produced; the model itself is only changed by `apply_`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..adapters.base import ArchitectureAdapter
from ..calibration.capture import capture_module_inputs
from ..calibration.states import CalibratedStates
from ..compression.method import CompressionMethod, MethodContext
from ..compression.workspace import Phase, Term, WorkspaceModel, WorkspaceSizes
from ..ops import kv_group_scores, top_k_indices
from ..ops.channel_sensitivity import (
    accumulate_abs_sum,
    channel_sensitivity,
    head_channel_totals,
    proportional_shares,
)
from ..ops.selection import max_merges, merge_leaves_room
from ..options.methods.come import CoMeConfig
from ..plan import LayerPlan
from ..registry import register_method
from ..utils.offload import detached_copy, dispatch_like
from .flattengpt import fold_block_norms_

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    """One layer of the stack being merged: original layers `indices`, computed by `module`.

    `built` marks a merged block the method owns (not a layer of the model), which it may copy and discard.
    """

    indices: tuple[int, ...]
    module: nn.Module
    built: bool = False

    @property
    def first(self) -> int:
        return self.indices[0]


@dataclass
class _Measurement:
    """One pass over the current stack: what selection, shares and scores need."""

    block_influence: list[float]
    #: distance[k]: angular distance between the input of entry k and the output of entry k + 1.
    distance: list[float]
    #: Per entry, mean |activation| of every o_proj input channel and of every down-projection input channel.
    head_activation: list[torch.Tensor]
    mlp_activation: list[torch.Tensor]
    tokens: int


@register_method("come")
class CoMeMethod(CompressionMethod):
    config_class = CoMeConfig
    requires_calibration = True
    # The same views FlattenGPT needs: heads and MLP channels of two pre-norm blocks concatenated into one.
    required_capabilities = frozenset({"head_geometry", "pre_norm", "concat_heads"})
    merges_layers = True
    config: CoMeConfig

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """CoMe: n steps, each one pass over the current stack (Block Influence, angular distances, |activation| sums)
        and one merge of two layers into one of the same width.

        - selection: the runner's layer-0 states, the previous input and the current boundary (2S), the boundary being
          computed, and at the down-projection hook the float64 |activation| of one batch and its masked product
          (16·T_b·i) beside the MLP activation; or the float64 cosine of one batch (40·T_b·d); plus the merged blocks
          of the earlier steps (one layer each, n − 1 at most).
        - merge: copies of the two members (2 layers), the wide block (2 layers, built as FlattenGPT's: the last weight
          of the copy it starts from, d·i, is still held when the last concatenation lands), and the earlier merged
          blocks (a bound: a chain frees the block it merges again).
        Cost: step s runs the L − s layers of the current stack.
        """
        s = z.shape
        built = Term("merged blocks of the earlier steps", (n - 1) * s.layer_bytes, "kept until the plan is applied")
        at_hook = (2 * z.d + z.i) * z.Tb * z.b + 16 * z.Tb * z.i
        selection = Phase(
            "selection",
            (
                z.tokens(),
                *z.runners(1),
                Term("the previous input and the current boundary", 2 * z.S, ""),
                built,
                Term(
                    "largest per-batch work: a layer run with the |activation| hook, or the float64 cosine",
                    max(z.run_outputs() + max(z.block_forward(), at_hook), 40 * z.Tb * z.d),
                    "float64 |x| and its masked product at the down projection",
                ),
            ),
        )
        merge = Phase(
            "merge",
            (
                z.tokens(),
                *z.runners(1),
                built,
                Term(
                    "member copies and the wide block, with the last weight of the copy it starts from",
                    4 * s.layer_bytes + z.d * z.i * z.b,
                    "as FlattenGPT's flatten: the wide block starts as a copy of the first member",
                ),
            ),
        )
        passes = sum((s.num_layers - step) / s.num_layers for step in range(n))
        return [selection, merge], passes, False, []

    def __init__(self, config: CoMeConfig) -> None:
        super().__init__(config)
        #: Merged blocks built by `plan`, by plan group, waiting for `apply_`.
        self._built: dict[tuple[int, ...], nn.Module] = {}

    # -------------------------------------------------------------- selection
    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        """Without chaining each merge joins two layers merged with nothing yet, so at most half the stack goes; fewer
        where layers of different kinds (`one_kind`) cannot be merged (`ops.max_merges`)."""
        if not self.config.allow_chaining and num_to_remove > num_layers // 2:
            raise ValueError(
                f"without chaining (allow_chaining=False) each merge joins two layers merged with nothing yet, so a "
                f"stack of {num_layers} layers can lose at most {num_layers // 2}; requested {num_to_remove}. Allow "
                "chaining or remove fewer layers."
            )
        possible = max_merges([(i,) for i in range(num_layers)], self._limit(num_layers), one_kind)
        if num_to_remove > possible:
            raise ValueError(
                f"{num_to_remove} merges cannot be made in a stack of {num_layers} layers whose layers are of several "
                f"kinds (sliding and full attention, or layers without rotary positions), which are never merged: "
                f"at most {possible} (allow_chaining={self.config.allow_chaining}); remove fewer layers."
            )

    def _limit(self, num_layers: int) -> int:
        """The largest merged group: two layers without chaining, any number with it."""
        return num_layers if self.config.allow_chaining else 2

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        stack = context.stack
        num_layers = adapter.num_layers(stack)
        states = context.new_states(adapter, keep=())
        entries = [_Entry((i,), layer) for i, layer in enumerate(adapter.layers(stack))]
        merges: list[dict[str, Any]] = []
        self._built = {}
        one_kind = adapter.layer_kind_rule(stack)
        with context.progress_bar(num_to_remove, "come") as bar:
            for step in range(num_to_remove):
                with context.timer("selection"):
                    measured = self._measure(adapter, states, entries)
                chaining = self.config.allow_chaining
                candidates = [
                    k
                    for k in range(len(entries) - 1)
                    if (chaining or (len(entries[k].indices) == 1 and len(entries[k + 1].indices) == 1))
                    # Layers the config describes differently (sliding and full attention, NoPE) are never merged.
                    and one_kind(entries[k].indices + entries[k + 1].indices)
                ]
                if not candidates:
                    raise ValueError(
                        f"after {step} merge(s) no two adjacent layers of one kind are left to merge (allow_chaining="
                        f"{self.config.allow_chaining}); requested {num_to_remove}. Allow chaining or remove fewer "
                        "layers."
                    )
                # Smallest distance, ties to the lower position, among the merges that leave the rest of the target
                # reachable (one that strands it would fail later anyway; see `ops.max_merges`).
                ranked = sorted(candidates, key=lambda c: (measured.distance[c], c))
                remaining, limit = num_to_remove - step - 1, self._limit(num_layers)
                groups = [entry.indices for entry in entries]
                k = next((c for c in ranked if merge_leaves_room(groups, c, remaining, limit, one_kind)), ranked[0])
                with context.timer("merge"):
                    block, record = self._merge_entries(adapter, stack, entries[k], entries[k + 1], k, measured)
                record = {"step": step, "angular_distance": round(measured.distance[k], 6), **record}
                record["distances"] = [round(d, 6) for d in measured.distance]
                merges.append(record)
                entries[k : k + 2] = [_Entry(entries[k].indices + entries[k + 1].indices, block, built=True)]
                bar.set_description(f"merge {step + 1}/{num_to_remove}: {record['members']}")
                bar.update()
        self._built = {e.indices: e.module for e in entries if e.built}
        context.report["merges"] = merges
        return LayerPlan(
            num_layers=num_layers,
            groups=[e.indices for e in entries],
            rule="come",
            stack=stack,
        )

    def _measure(
        self, adapter: ArchitectureAdapter, states: CalibratedStates, entries: Sequence[_Entry]
    ) -> _Measurement:
        """One pass of the current stack on the calibration states: Block Influence of every entry, angular distance
        of every adjacent pair (last token), and mean |activation| entering every o_proj and down projection.

        Three boundaries are alive at a time; each entry runs with the call arguments of its first original layer.
        """
        runner = states.runner
        masks = states.masks
        batch = [0]
        sums: list[list[torch.Tensor | None]] = [[None, None] for _ in entries]
        counts = [[0, 0] for _ in entries]

        def collector(k: int, slot: int):
            def collect(x: torch.Tensor) -> None:
                total, count = accumulate_abs_sum(x, masks[batch[0]])
                current = sums[k][slot]
                sums[k][slot] = total if current is None else current + total
                counts[k][slot] += count

            return collect

        block_influence: list[float] = []
        distance: list[float] = []
        previous_input: list[torch.Tensor] | None = None
        current = states.boundary(0)
        with contextlib.ExitStack() as hooks:
            for k, entry in enumerate(entries):
                view = adapter.block_view(entry.module, entry.first)
                hooks.enter_context(capture_module_inputs(view.attention.o.module, collector(k, 0)))
                hooks.enter_context(capture_module_inputs(view.mlp.down.module, collector(k, 1)))
            for entry in entries:
                output = runner.run(entry.module, entry.first, current, on_batch=lambda b: batch.__setitem__(0, b))
                block_influence.append(1.0 - states.mean_cosine(current, output, tokens="all"))
                if previous_input is not None:
                    distance.append(states.mean_angular_distance(previous_input, output, tokens="last"))
                previous_input, current = current, output
        if any(c == 0 for pair in counts for c in pair):
            raise ValueError("no calibration token is unmasked: cannot score heads and neurons.")
        head = [s[0].cpu() / c[0] for s, c in zip(sums, counts, strict=True)]
        mlp = [s[1].cpu() / c[1] for s, c in zip(sums, counts, strict=True)]
        return _Measurement(block_influence, distance, head, mlp, counts[0][1])

    # ------------------------------------------------------------------ merge
    def _merge_entries(
        self, adapter: ArchitectureAdapter, stack: str, a: _Entry, b: _Entry, k: int, measured: _Measurement
    ) -> tuple[nn.Module, dict[str, Any]]:
        """Scores, shares and concatenation of entries k (= a) and k + 1 (= b); returns the block and its record."""
        members = [self._owned_view(adapter, stack, entry) for entry in (a, b)]
        influence = [measured.block_influence[k], measured.block_influence[k + 1]]
        num_kv = members[0].attention.geometry.num_kv_heads
        width = members[0].mlp.intermediate_size
        if any(m.attention.geometry.num_kv_heads != num_kv or m.mlp.intermediate_size != width for m in members):
            raise ValueError(
                f"layers {list(a.indices)} and {list(b.indices)} differ in KV groups or MLP width; CoMe merges layers "
                "of one shape into one of the same shape."
            )
        kv_shares = proportional_shares(influence, num_kv, self.config.share_rounding)
        channel_shares = proportional_shares(influence, width, self.config.share_rounding)
        kept_kv: list[list[int]] = []
        kept_channels: list[list[int]] = []
        group_scores_report = []
        for m, member in enumerate(members):
            geometry = member.attention.geometry
            head_scores = head_channel_totals(
                channel_sensitivity(measured.head_activation[k + m], member.attention.o.weight), geometry.num_heads
            )
            group_scores = kv_group_scores(head_scores, geometry.num_kv_heads)
            neuron_scores = channel_sensitivity(measured.mlp_activation[k + m], member.mlp.down.weight)
            kept_kv.append(top_k_indices(group_scores, kv_shares[m]))
            kept_channels.append(top_k_indices(neuron_scores, channel_shares[m]))
            group_scores_report.append([round(float(s), 6) for s in group_scores])
        block = concat_merge(adapter, members, kept_kv, kept_channels, self.config.fold_norms)
        del members
        # Offloaded right away like the layer it will replace, so peak memory stays at one group being built.
        block = dispatch_like(block, adapter.layers(stack)[a.first])
        record = {
            "members": [list(a.indices), list(b.indices)],
            "block_influence": [round(v, 6) for v in influence],
            "kv_groups_per_member": kv_shares,
            "channels_per_member": channel_shares,
            "kv_group_scores": group_scores_report,
            "kept_kv_groups": kept_kv,
            "calibration_tokens": measured.tokens,
        }
        return block, record

    @staticmethod
    def _owned_view(adapter: ArchitectureAdapter, stack: str, entry: _Entry) -> Any:
        """A view of an in-memory, hook-free copy of the entry that may be rewritten (the model is never written)."""
        if not entry.built:
            return adapter.detached_block(stack, entry.first)
        # A block built by an earlier merge: copied too, since it may be offloaded (its weights then live elsewhere).
        copy = detached_copy(entry.module, memo={id(adapter.config): adapter.config})
        return adapter.block_view(copy, entry.first)

    # ------------------------------------------------------------- application
    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        if plan.dropped_indices:
            raise ValueError(f"CoMe plans cover every layer; got dropped layers {plan.dropped_indices}.")
        missing = [list(g) for g in plan.merged_groups if g not in self._built]
        if missing:
            raise ValueError(
                f"CoMe builds its merged layers while planning (each merge is measured on the model the earlier ones "
                f"produced), but no block was built for the groups {missing}; apply the plan this method's plan() "
                "returned."
            )
        for group in plan.merged_groups:
            adapter.replace_block_(plan.stack, group[0], self._built[group])
        adapter.keep_layers_(plan.stack, plan.first_indices)
        self._built = {}


def concat_merge(
    adapter: ArchitectureAdapter,
    members: Sequence[Any],
    kept_kv: Sequence[Sequence[int]],
    kept_channels: Sequence[Sequence[int]],
    fold_norms: bool = False,
) -> nn.Module:
    """One block holding the kept KV groups (with their query heads) and MLP channels of every member, side by side.

    The members (views of blocks the caller owns) are rewritten: their norms are folded or set to unit gain, since
    the adapter concatenates only plain normalisations. Without `fold_norms` the merged block's norms are then set to
    the mean of the members' norms (CoMe's approximation: each member's projections now read the mean gain instead
    of their own); with it, each member's gains live in its own q/k/v and gate/up columns and the block computes
    the pruned members exactly in parallel on one input.

    Args:
        adapter: The model's architecture adapter.
        members: `BlockView`s of the blocks to merge, in layer order.
        kept_kv: Per member, the KV groups it keeps (indices within that member); may be empty.
        kept_channels: Per member, the MLP channels it keeps; may be empty.
        fold_norms: Fold each member's norm gains into its projections instead of averaging the norms.
    """
    if not len(members) == len(kept_kv) == len(kept_channels):
        raise ValueError("one list of kept KV groups and one of kept channels is needed per member.")
    averaged: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    if fold_norms:
        for member in members:
            fold_block_norms_(member)
    else:
        for name in ("attn_norm", "mlp_norm"):
            norms = [getattr(m, name) for m in members]
            weight = torch.stack([n.weight.double() for n in norms]).mean(dim=0)
            biases = [n.bias for n in norms]
            bias = None if any(b is None for b in biases) else torch.stack([b.double() for b in biases]).mean(dim=0)
            averaged.append((weight, bias))
        for member in members:
            member.attn_norm.set_unit_()
            member.mlp_norm.set_unit_()
    wide = adapter.build_concat_block(members)
    index = members[0].index
    kv_offsets = [0]
    channel_offsets = [0]
    for member in members:
        kv_offsets.append(kv_offsets[-1] + member.attention.geometry.num_kv_heads)
        channel_offsets.append(channel_offsets[-1] + member.mlp.intermediate_size)
    wide_kv = [kv_offsets[m] + int(g) for m, groups in enumerate(kept_kv) for g in groups]
    wide_channels = [channel_offsets[m] + int(c) for m, channels in enumerate(kept_channels) for c in channels]
    adapter.keep_heads_(adapter.block_view(wide, index), wide_kv)
    view = adapter.block_view(wide, index)
    adapter.keep_mlp_channels_(view, wide_channels)
    if not fold_norms:
        for norm, (weight, bias) in zip((view.attn_norm, view.mlp_norm), averaged, strict=True):
            norm.weight.copy_(weight)
            if bias is not None and norm.bias is not None:
                norm.bias.copy_(bias)
    return wide
