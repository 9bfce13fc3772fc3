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

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import LayerwiseRunner
from ...calibration.distributed import all_reduce_, all_reduce_sums, is_sharded
from ...calibration.partial import run_to_input
from ...calibration.stats import CentredSecondMoment, CrossMoment, SecondMoment
from ...compression.compute import ComputeModel
from ...compression.method import CardSection, CompressionMethod, LayerMatrixFigure, MethodContext
from ...compression.workspace import WorkspaceModel, WorkspaceSizes
from ...ops import (
    accumulate_head_importance,
    balanced_top_k,
    default_ridge_lambda,
    fold_norm_into_linear,
    greedy_adjacent_groups,
    kv_group_scores,
    nystrom_down_correction,
    o_proj_column_norms,
    ridge_leverage_scores,
    top_k_indices,
)
from ...ops.ridge import (
    kept_block,
    kept_blocks,
    nystrom_from_factor,
    ridge_factor,
    ridge_leverage_scores_packed,
    ridge_refit_to_target,
)
from ...options.methods.flattengpt import FlattenGPTConfig, resolve_covariance_dtype
from ...plan import LayerPlan
from ...registry import register_method
from ...utils import flops
from ...utils.offload import dispatch_like
from ...utils.torch_utils import module_device
from .attention_target import attention_writes_from_states, sequential_attention_writes, sequential_group_outputs
from .choices import MLP_CROSS_CHUNK, cross_path
from .compute import flattengpt_compute
from .kv_groups import select_kv_groups_by_reconstruction
from .loss_selection import groups_by_calibration_loss, install_prebuilt_
from .resume import rebuild_group, selection_caches
from .similarity import as_cached, similarity_matrix
from .workspace import flattengpt_workspace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _WideBlock:
    """What the pruning steps of one merged group share: the wide block, the position it takes, the calibration
    inputs it runs on, and the runner and context they run under."""

    adapter: ArchitectureAdapter
    runner: LayerwiseRunner
    wide: nn.Module
    indices: tuple[int, ...]
    inputs: list[torch.Tensor]
    context: MethodContext

    @property
    def first(self) -> int:
        return self.indices[0]


#: The file the similarity heatmap is written to, beside the checkpoint.
SIMILARITY_FIGURE = "similarity_heatmap.png"


@register_method("flattengpt")
class FlattenGPTMethod(CompressionMethod):
    merges_layers = True
    config_class = FlattenGPTConfig
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
        groups = greedy_adjacent_groups(similarity, num_to_remove, self.config.max_group_size)
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
        group = _WideBlock(adapter, runner, wide, tuple(indices), inputs, context)
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
        """The members' norm gains folded into copies of them, concatenated into one wide block (exact: the wide
        block computes the members in parallel on one input)."""
        with context.timer("flatten"):
            members = [adapter.detached_block(context.stack, i) for i in indices]
            for member in members:
                fold_block_norms_(member)
            return adapter.build_concat_block(members)

    def _prune_heads(
        self,
        group: _WideBlock,
        target_kv: int,
        group_outputs: list[torch.Tensor] | None = None,
        states: dict[int, list[torch.Tensor]] | None = None,
    ) -> dict[str, Any]:
        """Keeps `target_kv` whole KV groups of the wide block, by f_i (eq. 12) or by reconstruction, and refits
        o_proj on the kept heads when `attention_correction` asks (Nyström on the o_proj input's second moment).

        Only the attention up to o_proj runs: the head scores and the o_proj moment read its input. With the
        sequential target and `group_outputs` given, the members' run for their writes goes on to their outputs,
        which `group_outputs` receives for the MLP's target. With `states` holding every later member's input, each
        member runs only its attention, on its own input (`attention_writes_from_states`).
        """
        adapter, runner, wide, inputs, context = group.adapter, group.runner, group.wide, group.inputs, group.context
        view = adapter.block_view(wide, group.first)
        geometry = view.attention.geometry
        column_norms = o_proj_column_norms(view.attention.o.weight, geometry.num_heads)
        head_sum = torch.zeros(geometry.num_heads, dtype=torch.float64)
        head_count = 0
        needs_o_moment = self.config.attention_correction or self.config.head_selection == "reconstruction"
        device = module_device(wide)  # statistics and solves stay on the device the layer lives on
        heads_width = geometry.num_heads * geometry.head_dim
        precision = self._covariance_dtype(view.attention.o.weight, device, heads_width)
        tf32, split = precision == "tf32", precision == "bfloat16"
        o_moment = SecondMoment(heads_width, device, tf32, split_bfloat16=split) if needs_o_moment else None
        sequential = self.config.attention_target == "sequential"
        o_module = view.attention.o.module
        writes: list[torch.Tensor] = []
        heads_width, hidden = geometry.num_heads * geometry.head_dim, view.attention.o.weight.shape[0]
        # One rule for the run and the memory model (`choices.cross_path`).
        centred = cross_path(precision, str(view.attention.o.weight.dtype)) == "centred"
        cross = (
            CrossMoment(heads_width, hidden, device, split_bfloat16=split, centred_float32=centred)
            if sequential
            else None
        )
        bias = None if getattr(o_module, "bias", None) is None else o_module.bias.detach().float()

        def on_heads(b: int, x: torch.Tensor) -> None:
            nonlocal head_sum, head_count
            mask = runner.masks[b]
            total, count = accumulate_head_importance(x, column_norms, mask)
            head_sum += total.cpu()
            head_count += count
            if o_moment is not None:
                o_moment.update(x, mask)
            if cross is not None:  # the target less the bias o_proj keeps as it is
                target = writes[b].to(x.device)
                cross.update(x, target if bias is None else target - bias.to(x.device), mask)
                writes[b] = None  # type: ignore[call-overload]

        after_o = [o_module, view.mlp_norm.module, view.mlp.module]
        with context.timer("head_scoring"):
            if sequential and states:
                later = [states.pop(i) for i in group.indices[1:]]  # read here only
                writes = attention_writes_from_states(adapter, runner, context.stack, group.indices, [inputs, *later])
                del later
            elif sequential:
                writes = sequential_attention_writes(
                    adapter, runner, context.stack, group.indices, inputs, group_outputs
                )
            run_to_input(runner, wide, group.first, inputs, o_module, on_heads, after_o)
        if is_sharded():  # the head sums of every rank's share, before they are used
            all_reduce_(head_sum)
            (count,) = all_reduce_sums(head_count)
            head_count = int(count)
        head_scores = head_sum / max(head_count, 1)
        group_scores = kv_group_scores(head_scores, geometry.num_kv_heads)
        o_weight = None
        if self.config.head_selection == "balanced":
            kept_kv = balanced_top_k(group_scores, target_kv, geometry.num_kv_heads // target_kv)
        elif self.config.head_selection == "importance":
            kept_kv = top_k_indices(group_scores, target_kv)
        # "reconstruction" chooses below, from the o_proj moment it implies.
        if o_moment is not None:
            with context.timer("attention_solve"):
                o_second_moment = o_moment.finish()
                o_ratio = self.config.attention_ridge_ratio or self.config.ridge_ratio
                o_lam = default_ridge_lambda(o_second_moment, o_ratio)
                o_rows = view.attention.o.weight.T
                target = cross.finish() if cross is not None else None
                if self.config.head_selection == "reconstruction":
                    kept_kv = select_kv_groups_by_reconstruction(
                        o_second_moment, o_rows, geometry, target_kv, o_lam, target
                    )
                if self.config.attention_correction:
                    channels = torch.tensor(geometry.head_channels(geometry.query_heads_of(kept_kv)))
                    if target is None:
                        o_weight = nystrom_down_correction(o_second_moment, o_rows, channels, o_lam).T
                    else:
                        o_weight = ridge_refit_to_target(o_second_moment, target[0], o_rows, channels, o_lam).T
                del o_second_moment, o_rows, o_moment, target  # freed before the (larger) MLP statistics
        adapter.keep_heads_(view, kept_kv, o_weight)
        return {
            "num_kv_groups": geometry.num_kv_heads,
            "kv_group_scores": [round(float(s), 6) for s in group_scores],
            "kept_kv_groups": kept_kv,
        }

    def _prune_channels(
        self,
        group: _WideBlock,
        target_channels: int,
        group_outputs: list[torch.Tensor] | None = None,
        traced_outputs: list[torch.Tensor] | None = None,
        states: dict[int, list[torch.Tensor]] | None = None,
    ) -> dict[str, Any]:
        """Keeps `target_channels` MLP channels by ridge leverage and refits the down projection on them (Nyström),
        on the activations the pruned attention produces; the down projection, whose input is the statistic, does
        not run. The sequential target reads the original group's outputs: the state entering the next layer when
        `states` holds it, `traced_outputs` when the attention's run of the members already gave them, else the
        members run once more."""
        adapter, runner, wide, inputs, context = group.adapter, group.runner, group.wide, group.inputs, group.context
        view = adapter.block_view(wide, group.first)
        width = view.mlp.intermediate_size
        device = module_device(wide)
        precision = self._covariance_dtype(view.mlp.down.weight, device, width)
        float64 = precision == "float64"
        tf32, split = precision == "tf32", precision == "bfloat16"
        moment = (
            SecondMoment(width, device)
            if float64
            else CentredSecondMoment(width, device, tf32=tf32, split_bfloat16=split)
        )
        sequential = self.config.mlp_target == "sequential"  # the config refuses it without mlp_correction
        down = view.mlp.down.module
        # Chunks of 1,024 tokens: each takes a float64 copy of the wide activations (0.5 GiB at LLaMA-2-70B's 57,344).
        hidden = view.mlp.down.weight.shape[0]
        centred = cross_path(precision, str(view.mlp.down.weight.dtype)) == "centred"
        cross = (
            CrossMoment(width, hidden, device, MLP_CROSS_CHUNK, split_bfloat16=split, centred_float32=centred)
            if sequential
            else None
        )
        bias = None if getattr(down, "bias", None) is None else down.bias.detach().float()
        outputs: list[torch.Tensor] = []
        residual: list[torch.Tensor] = []  # the MLP norm's input of the batch running (read before its down input)

        def on_mlp_norm(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            residual[:] = [args[0]]

        def on_mlp(b: int, x: torch.Tensor) -> None:
            mask = runner.masks[b]
            moment.update(x, mask)
            if cross is not None:  # what the block must still write, less the bias the projection keeps
                target = outputs[b].to(x.device).float() - residual.pop().to(x.device).float()
                cross.update(x, target if bias is None else target - bias.to(x.device), mask)
                if group_outputs is None:  # else kept for the caller, who propagates them
                    outputs[b] = None  # type: ignore[call-overload]

        with context.timer("covariance"):
            if sequential and states:  # `member_states` names the layer after the group with the MLP's target
                outputs = states.pop(group.indices[-1] + 1)
            elif sequential and traced_outputs is not None:
                outputs = traced_outputs
            elif sequential:
                outputs = sequential_group_outputs(adapter, runner, context.stack, group.indices, inputs)
            handle = view.mlp_norm.module.register_forward_pre_hook(on_mlp_norm) if sequential else None
            try:
                run_to_input(runner, wide, group.first, inputs, down, on_mlp, [down])
            finally:
                if handle is not None:
                    handle.remove()
            if group_outputs is not None:
                group_outputs.extend(outputs)
        with context.timer("solve"):
            down_rows = view.mlp.down.weight.T
            target = cross.finish()[0] if cross is not None else None
            if float64:
                kept_channels, corrected, lam = self._mlp_float64(moment, down_rows, target_channels, target)
            else:
                kept_channels, corrected, lam = self._mlp_float32(moment, down_rows, target_channels, target)
            adapter.keep_mlp_channels_(view, kept_channels, corrected.T)
        # Read after `finish`, which sums a sharded calibration's counts over the ranks.
        return {
            "kept_channels": kept_channels,
            "ridge_lambda": lam,
            "calibration_tokens": moment.count,
            "covariance_dtype": precision,
        }

    def _covariance_dtype(self, weight: torch.Tensor, device: torch.device, width: int) -> str:
        """The precision of a statistic of `width` channels read from the input of `weight`'s projection: the
        option, or for ``"auto"`` what `resolve_covariance_dtype` gives for the activations' dtype (the weight's:
        the block computes in it) on `device`."""
        return resolve_covariance_dtype(self.config.covariance_dtype, str(weight.dtype), device.type == "cuda", width)

    def _mlp_float64(
        self, moment: SecondMoment, down_rows: torch.Tensor, num_keep: int, target: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor, float]:
        """Leverage and Nyström (or the ridge refit towards `target`'s cross moment) on a float64 C with a full
        float64 factor (the reference path)."""
        second_moment = moment.finish()
        lam = default_ridge_lambda(second_moment, self.config.ridge_ratio)
        kept_channels = top_k_indices(ridge_leverage_scores(second_moment, lam), num_keep)
        if not self.config.mlp_correction:
            return kept_channels, down_rows[torch.tensor(kept_channels, device=down_rows.device)], lam
        keep = torch.tensor(kept_channels)
        if target is not None:
            return kept_channels, ridge_refit_to_target(second_moment, target, down_rows, keep, lam), lam
        corrected = nystrom_down_correction(second_moment, down_rows, keep, lam)
        return kept_channels, corrected, lam

    def _mlp_float32(
        self, moment: CentredSecondMoment, down_rows: torch.Tensor, num_keep: int, target: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor, float]:
        """Leverage from a triangle-only float32 factor (the channels near the cut re-scored in float64, so the
        kept set is the float64 path's); the Nyström solve on the kept block in float64.

        Holds at most the float32 scatter with either the factor's triangle or the float64 kept block and
        C[K, R] W_D[R]; the scatter is dropped before the kept block is factorised, and the block once it is.
        """
        stats = moment.finish()
        lam = self.config.ridge_ratio * stats.trace() / stats.dim
        leverage = ridge_leverage_scores_packed(
            lambda start, stop: stats.block(slice(start, None), slice(start, stop)),
            stats.dim,
            lam,
            refine_top_k=num_keep,
        )
        kept_channels = top_k_indices(leverage, num_keep)
        keep = torch.tensor(kept_channels, device=down_rows.device)
        if not self.config.mlp_correction:
            stats.release()
            return kept_channels, down_rows[keep], lam
        if target is None:
            kept, cross = kept_blocks(stats.block, stats.dim, down_rows, keep)
            stats.release()
        else:  # S_K − C_KK W_K in place of Nyström's C_KR W_R (`ridge_refit_to_target`): C[K, R] is not read
            kept = kept_block(stats.block, keep, down_rows.device)
            stats.release()
            flops.record(flops.product(keep.numel(), keep.numel(), down_rows.shape[1]), "float64")
            cross = target[keep.to(target.device)].to(kept.device) - kept @ down_rows[keep].double()
        factor = ridge_factor(kept, lam)
        del kept  # the solve copies the factor once more (column-major): the block would be a third k x k
        corrected = nystrom_from_factor(factor, cross, down_rows[keep])
        return kept_channels, corrected, lam


def fold_block_norms_(block: Any) -> None:
    """Folds a pre-norm block's norm gains (and LayerNorm biases) into q/k/v and gate/up, leaving unit norms.

    Function-preserving: the block computes the same outputs before and after.
    """
    attention_readers = [block.attention.q, block.attention.k, block.attention.v]
    mlp_readers = [block.mlp.up] + ([block.mlp.gate] if block.mlp.gate is not None else [])
    for norm, readers in ((block.attn_norm, attention_readers), (block.mlp_norm, mlp_readers)):
        if norm.is_unit():
            continue
        for linear in readers:
            linear.set_(*fold_norm_into_linear(linear.weight, linear.bias, norm.weight, norm.bias))
        norm.set_unit_()
