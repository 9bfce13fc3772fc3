"""FlattenGPT (arXiv 2602.08858): merge adjacent layers into one wide layer, then prune it back to the original width.

1. Select: S[i, j] = mean token cosine similarity of the inputs of layers i and j; greedily merge the adjacent
   pair of groups with the highest similarity (a group is judged by its first and last members). Or, not in the
   paper, by calibration loss (``selection="loss"`` or ``"wide_loss"``, `flattengpt.loss_selection`).
2. Flatten: fold every member's norm gains into the projections reading the norm, set the gains to 1, and
   concatenate heads and MLP channels; the wide block computes the members in parallel on one input.
3. Prune back: keep the H heads (whole KV groups under GQA) with the largest importance f_i, and the d_int MLP
   channels with the largest ridge leverage, correcting the down projection with the Nyström formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import LayerwiseRunner
from ...compression.compute import ComputeModel
from ...compression.method import CardSection, CompressionMethod, LayerMatrixFigure, MethodContext
from ...compression.workspace import WorkspaceModel, WorkspaceSizes
from ...ops import greedy_adjacent_groups
from ...ops.selection import max_merges
from ...options.methods.flattengpt import FlattenGPTConfig
from ...plan import LayerPlan
from ...registry import register_method
from ...utils.offload import dispatch_like
from .channel_pruning import prune_channels
from .compute import flattengpt_compute
from .flatten import WideBlock, flatten_group
from .head_pruning import prune_heads
from .loss_selection import groups_by_calibration_loss, install_prebuilt_
from .resume import rebuild_group, selection_caches
from .similarity import as_cached, similarity_matrix
from .workspace import flattengpt_workspace

#: The file the similarity heatmap is written to, beside the checkpoint.
SIMILARITY_FIGURE = "similarity_heatmap.png"


@register_method("flattengpt")
class FlattenGPTMethod(CompressionMethod):
    merges_layers = True
    config_class = FlattenGPTConfig
    reads_mlp_projections = True
    requires_calibration = True
    required_capabilities = frozenset({"head_geometry", "pre_norm", "concat_heads"})
    config: FlattenGPTConfig
    #: The similarity sums, the head-importance sums and the second and cross moments are summed over the ranks.
    shards_calibration = True
    #: The layer-input similarity heatmap (`card_section`).
    checkpoint_files: ClassVar[tuple[str, ...]] = (SIMILARITY_FIGURE,)

    def resume_refusal(self) -> str | None:
        """Each merged group is saved as it finishes (`apply_`); not the loss selection's, built while planning."""
        if self.config.selection == "loss":
            return (
                "flattengpt with selection='loss' compresses its groups while selecting, before a plan can be saved "
                "(use selection='similarity' or 'wide_loss')"
            )
        return None

    def sharding_refusal(self) -> str | None:
        if self.config.selection != "similarity":
            return (
                f"selection={self.config.selection!r} scores candidates by next-token loss on the first "
                "scoring_batches batches (use selection='similarity')"
            )
        return None

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
        """FlattenGPT's memory model (`flattengpt_workspace`)."""
        return flattengpt_workspace(z, n, config)

    @classmethod
    def compute(cls, z: WorkspaceSizes, n: int, config: Any) -> ComputeModel:
        """FlattenGPT's compute model (`flattengpt_compute`)."""
        return flattengpt_compute(z, n, config)

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """The similarity heatmap the selection measured, merged groups outlined; with a loss selection, each merge
        and its calibration NLL against the runner-up's (nothing when the report has neither)."""
        steps = report.get("selection_steps")
        if steps:
            lines = tuple(
                f"Merge {k + 1} chosen by calibration loss: {step['merged']} (next-token NLL {step['nll']:.4f} on the "
                "scored calibration batches"
                + (
                    f"; runner-up {step['runner_up']['merged']} at {step['runner_up']['nll']:.4f})"
                    if "runner_up" in step
                    else ")"
                )
                for k, step in enumerate(steps)
            )
            return CardSection(lines=lines)
        similarity = report.get("similarity")
        if similarity is None:
            return None
        figure = LayerMatrixFigure(
            file_name=SIMILARITY_FIGURE,
            caption="Layer-input similarity, merged groups outlined",
            matrix=similarity,
            groups=(report.get("plan") or {}).get("groups"),
            value_label="mean token cosine similarity of layer inputs",
        )
        return CardSection(figures=(figure,))

    # -------------------------------------------------------------- selection

    def similarity_matrix(self, adapter: ArchitectureAdapter, context: MethodContext) -> torch.Tensor:
        """`similarity.similarity_matrix`, keeping what the pass leaves for `apply_` on the same context."""
        similarity, self._cache = similarity_matrix(adapter, context, self.config)
        return similarity

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        """Groups of at most `max_group_size` layers keep one layer each, so at most ``L - ceil(L / g)`` go; fewer
        where layers of different kinds (`one_kind`) cannot share a group (`ops.max_merges`)."""
        group = self.config.max_group_size
        singles = [(i,) for i in range(num_layers)]
        possible = max_merges(singles, group or num_layers, one_kind)
        if num_to_remove <= possible:
            return
        if group is not None and num_to_remove > num_layers - math.ceil(num_layers / group):
            raise ValueError(
                f"{num_to_remove} merges cannot be made within max_group_size={group} in a stack of {num_layers} "
                f"layers (at most {num_layers - math.ceil(num_layers / group)}: every merged group keeps one of at "
                f"most {group} layers); raise max_group_size or remove fewer layers."
            )
        unlimited = max_merges(singles, num_layers, one_kind)
        advice = "raise max_group_size or remove fewer" if unlimited >= num_to_remove else "remove fewer"
        raise ValueError(
            f"{num_to_remove} merges cannot be made in a stack of {num_layers} layers whose layers are of several "
            f"kinds (sliding and full attention, or layers without rotary positions), which never share a merged "
            f"group: at most {possible} within max_group_size={group}; {advice} layers."
        )

    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        self._prebuilt = None
        if self.config.selection in ("loss", "wide_loss"):
            self._cache = None
            prebuilt: dict[tuple[int, ...], tuple[nn.Module, dict[str, Any]]] = {}
            if self.config.selection == "loss":
                # Each candidate group compressed once, on the original model's states (one-pass): the block the
                # application would build, so the search scores the compressed model itself and the chosen blocks
                # are installed as they are.
                prebuilt = self._compress_candidates(adapter, context)

            def candidate(indices: tuple[int, ...]) -> nn.Module:
                return prebuilt[indices][0] if prebuilt else self._flatten(adapter, indices, context)

            groups, steps = groups_by_calibration_loss(
                adapter, context, num_to_remove, self.config.max_group_size, self.config.scoring_batches, candidate
            )
            context.report["selection_steps"] = steps
            if prebuilt:
                self._prebuilt = (context, {g: prebuilt[g] for g in groups if len(g) > 1})
                prebuilt.clear()  # the candidates not chosen
            return LayerPlan(
                num_layers=adapter.num_layers(context.stack), groups=groups, rule="flatten_prune", stack=context.stack
            )
        similarity = self.similarity_matrix(adapter, context)
        groups = greedy_adjacent_groups(
            similarity,
            num_to_remove,
            self.config.max_group_size,
            one_kind=adapter.layer_kind_rule(context.stack),
        )
        context.report["similarity"] = [[None if v != v else round(float(v), 6) for v in row] for row in similarity]
        # Only the inputs of the layers that start a merged group are needed again, and those its sequential targets
        # read (`member_states`).
        num_layers = adapter.num_layers(context.stack)
        merged = [tuple(g) for g in groups if len(g) > 1]
        self._cache.keep_only([i for g in merged for i in (g[0], *self.member_states(g, num_layers))])
        return LayerPlan(
            num_layers=num_layers,
            groups=groups,
            rule="flatten_prune",
            stack=context.stack,
        )

    def _compress_candidates(
        self, adapter: ArchitectureAdapter, context: MethodContext
    ) -> dict[tuple[int, ...], tuple[nn.Module, dict[str, Any]]]:
        """Every group of 2..max_group_size consecutive layers, compressed on the original model's states entering
        it (one pass through the original stack, all calibration batches): (L − 1) blocks of one layer each with
        pairs, held until the plan is made."""
        runner = context.new_runner(adapter)
        layers = adapter.layers(context.stack)
        num_layers = len(layers)
        limit = self.config.max_group_size
        assert limit is not None  # the config refuses selection="loss" without a bound
        built: dict[tuple[int, ...], tuple[nn.Module, dict[str, Any]]] = {}
        current = runner.inputs
        with context.progress_bar(num_layers - 1, "flattengpt candidates") as bar:
            for first in range(num_layers - 1):
                for size in range(2, min(limit, num_layers - first) + 1):
                    indices = tuple(range(first, first + size))
                    built[indices] = self.compress_group(adapter, runner, indices, current, context)[:2]
                if first < num_layers - 2:
                    with context.timer("propagate"):
                        current = runner.run(layers[first], first, current)
                bar.set_description(f"block {first + 1}/{num_layers}: candidate groups")
                bar.update()
        return built

    # ------------------------------------------------------------- application
    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        """Compresses every merged group; each compressed block takes its first member's place as soon as nothing
        needs that member any more, so the model never holds more than one extra block."""
        if len({i for g in plan.groups for i in g.indices}) != plan.num_layers:
            raise ValueError(f"FlattenGPT plans cover every layer; got dropped layers {plan.dropped_indices}.")
        prebuilt, self._prebuilt = getattr(self, "_prebuilt", None), None
        if prebuilt is not None and prebuilt[0] is context:
            install_prebuilt_(adapter, plan, context, prebuilt[1])
            return
        cache, self._cache = getattr(self, "_cache", None), None
        if cache is not None and cache.context is not context:
            cache = None  # planned on other batches (or another model): nothing of it applies here
        runner = cache.runner if cache is not None else context.new_runner(adapter)
        layers = adapter.layers(context.stack)
        group_reports = []
        current = runner.inputs
        sequential = self.config.calibration_mode == "sequential"
        # One pass over the original model's states: its layer inputs may already be held from the selection.
        from_cache = cache is not None and cache.units is not None and not sequential
        if cache is not None and not from_cache:
            cache.keep_only(())
        resume = context.resume
        # Resuming, the states are propagated only as far as the last group still to compress: past it nothing
        # reads them (a finished job's rerun runs no layer). Without a resume_dir the run keeps its course.
        pending = [g.indices[0] for g in plan.groups if not g.is_keep and not (resume and resume.has_group(g.indices))]
        last_pending = max(pending, default=-1)
        # Uninterrupted, the groups are measured on the selection's cached inputs (`as_cached`); resumed, without the
        # selection, on the exact states rounded the same way: the same inputs bit for bit.
        rounded = resume is not None and cache is None
        rounded = rounded and selection_caches(self.config, context, plan.num_layers, sequential)
        with context.progress_bar(plan.num_layers, "flattengpt") as bar:
            for group in plan.groups:
                for index in group.indices:
                    bar.set_description(f"block {index + 1}/{plan.num_layers}: flatten-and-prune")
                first = group.indices[0]
                propagate = not from_cache and (resume is None or first < last_pending)
                members_ran = False  # a resumed group's members, run before it for the states its targets read
                if group.is_keep:
                    if propagate:
                        with context.timer("propagate"):
                            current = runner.run(layers[first], first, current)
                    bar.update()
                    continue
                saved = resume.load_group(group.indices) if resume is not None and first not in pending else None
                if saved is not None:
                    # Installed as the interrupted run built it; the states the next groups need are those the
                    # uninterrupted run propagates: the original members' (one pass) or this block's (sequential).
                    with context.timer("resume"):
                        block = rebuild_group(self._flatten, adapter, saved, context)
                    group_report, reuse = saved.report, None
                    del saved
                else:
                    inputs = cache.inputs(first) if from_cache else current
                    inputs = [as_cached(h) for h in inputs] if rounded else inputs
                    wanted = self.member_states(group.indices, plan.num_layers) if from_cache or rounded else ()
                    states: dict[int, list[torch.Tensor]] | None = None
                    if wanted and from_cache:
                        states = {i: cache.inputs(i) for i in wanted}
                    elif wanted:  # resumed: the exact states, propagated here, rounded as the cache rounds them
                        with context.timer("propagate"):
                            exact = {first: current}
                            for index in group.indices:
                                exact[index + 1] = runner.run(layers[index], index, exact[index])
                        current, members_ran = exact[group.indices[-1] + 1], True
                        states = {i: [as_cached(h) for h in exact[i]] for i in wanted}
                        del exact
                    # The MLP's sequential target runs the original members from these inputs: exactly the
                    # propagation the one-pass mode needs next, so their outputs are kept for it instead of running
                    # them again.
                    own_inputs = from_cache or rounded  # inputs that are not the states to propagate
                    reuse = [] if self._outputs_propagate(own_inputs, sequential) else None
                    block, group_report, kept = self.compress_group(
                        adapter, runner, group.indices, inputs, context, reuse, states
                    )
                    del inputs, states
                    if resume is not None:  # before the block is offloaded: its weights are still in memory
                        with context.timer("resume"):
                            resume.save_group(group.indices, block.state_dict(), *kept, group_report)
                # Offloaded again right away if the layer it replaces was: peak memory stays at one group.
                block = dispatch_like(block, layers[first])
                group_reports.append(group_report)
                if propagate and not members_ran:
                    with context.timer("propagate"):
                        if sequential:
                            current = runner.run(block, first, current)
                        elif reuse:
                            current, reuse = reuse, None  # no second reference once the next layers run
                        else:
                            for index in group.indices:
                                current = runner.run(layers[index], index, current)
                adapter.replace_block_(context.stack, first, block)
                del block
                bar.update(len(group.indices))
        adapter.keep_layers_(context.stack, plan.first_indices)
        context.report["groups"] = group_reports

    def member_states(self, indices: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
        """The layers whose inputs a merged group's sequential targets read, past its first: its later members'
        (the attention's target: each member's write on the state it reads in the original stack) and the layer's
        after it (the MLP's: the state the group leaves). In the one-pass mode those are the original model's
        states, which the selection's cache holds: with them no member runs whole (`compress_group`). Empty when
        no target is sequential, or when the group ends the stack (its output is no layer's input, so nothing
        holds it: the members run, as without the cache)."""
        wanted = list(indices[1:]) if self.config.attention_target == "sequential" else []
        if self.config.mlp_target == "sequential":
            wanted.append(indices[-1] + 1)
        return tuple(wanted) if wanted and wanted[-1] < num_layers else ()

    def _outputs_propagate(self, own_inputs: bool, sequential_calibration: bool) -> bool:
        """Whether a merged group's original outputs, computed for the MLP's target, are the states to propagate:
        in the one-pass mode when the group's inputs are the propagated states themselves (not the selection's
        cached inputs, nor a resumed run's rounded copy of the states, `as_cached`)."""
        return self.config.mlp_target == "sequential" and not own_inputs and not sequential_calibration

    def compress_group(
        self,
        adapter: ArchitectureAdapter,
        runner: LayerwiseRunner,
        indices: tuple[int, ...],
        inputs: list[torch.Tensor],
        context: MethodContext,
        group_outputs: list[torch.Tensor] | None = None,
        states: dict[int, list[torch.Tensor]] | None = None,
    ) -> tuple[torch.nn.Module, dict[str, Any], tuple[list[int], list[int]]]:
        """One merged group, in the paper's three steps: flatten the members into one wide block, prune its heads
        back to one layer's KV groups, then its MLP channels back to one layer's width (each step's statistics are
        taken on the block the previous step left), on `inputs`, the states entering the group's first layer.
        Returns the block, its report entry, and the kept KV groups and MLP channels (what `resume.rebuild_group`
        rebuilds the block's module from; the report keeps per-member counts only, a 70B group's channel list being
        tens of thousands of indices). `states`, when given, holds the original model's states entering the layers
        `member_states` names (per calibration batch; entries are consumed): the sequential targets are then read
        from them instead of running the members through.

        Public because a search that weighs merging a pair against other actions (`greedy_replace` with
        `allow_flatten`) builds the same block: the members are the model's own layers at `indices`, untouched.
        """
        first = adapter.block(context.stack, indices[0])  # shapes only: an offloaded layer's weights are on meta
        target_kv, target_channels = first.attention.geometry.num_kv_heads, first.mlp.intermediate_size
        wide = self._flatten(adapter, indices, context)
        group = WideBlock(adapter, runner, wide, tuple(indices), inputs, context)
        # With both sequential targets, one run of the members gives the attention writes and the group's outputs;
        # with the states `member_states` names held, the targets read them and no member runs whole.
        both = self.config.attention_target == "sequential" and self.config.mlp_target == "sequential"
        traced: list[torch.Tensor] | None = [] if both and not states else None
        heads = self._prune_heads(group, target_kv, traced, states)
        channels = self._prune_channels(group, target_channels, group_outputs, traced, states)
        num_kv = heads["num_kv_groups"]
        per_member = num_kv // len(indices)
        report = {
            "members": list(indices),
            "kv_group_scores": heads["kv_group_scores"],
            "kept_kv_groups": heads["kept_kv_groups"],
            "kept_kv_groups_per_member": [
                sum(1 for g in heads["kept_kv_groups"] if g // per_member == m) for m in range(len(indices))
            ],
            "kept_channels_per_member": [
                sum(1 for c in channels["kept_channels"] if c // target_channels == m) for m in range(len(indices))
            ],
            "ridge_lambda": channels["ridge_lambda"],
            "calibration_tokens": channels["calibration_tokens"],
            "covariance_dtype": channels["covariance_dtype"],
        }
        return wide, report, (list(heads["kept_kv_groups"]), list(channels["kept_channels"]))

    def _flatten(self, adapter: ArchitectureAdapter, indices: tuple[int, ...], context: MethodContext) -> nn.Module:
        """The wide block of the members at `indices` (`flatten.flatten_group`)."""
        return flatten_group(adapter, indices, context)

    def _prune_heads(
        self,
        group: WideBlock,
        target_kv: int,
        group_outputs: list[torch.Tensor] | None = None,
        states: dict[int, list[torch.Tensor]] | None = None,
    ) -> dict[str, Any]:
        """The head step on the wide block (`head_pruning.prune_heads`)."""
        return prune_heads(self.config, group, target_kv, group_outputs, states)

    def _prune_channels(self, group: WideBlock, target_channels: int, *sources: Any) -> dict[str, Any]:
        """The MLP step on the wide block (`channel_pruning.prune_channels`; `sources`: where the sequential target
        reads the group's outputs from)."""
        return prune_channels(self.config, group, target_channels, *sources)
