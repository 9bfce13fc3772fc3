"""The compressor: validate -> calibrate -> plan -> apply -> renumber and update config -> validate -> report."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from optimum.quantization_base import OptimumQuantizer
from torch import nn

from .adapters import get_adapter
from .adapters.base import ArchitectureAdapter
from .calibration.data import batches_of, build_image_batches, draw_dataset_rows, is_image_dataset
from .calibration.distributed import all_reduce_sums, shard_range, sharded_calibration
from .calibration.images import check_data_kind
from .compression import pipeline
from .compression.measured_cost import compute_cost, dense_forward_flops_of
from .compression.method import CompressionMethod, MethodContext
from .compression.pipeline import Corrections
from .compression.resume import ResumeState
from .compression.resume_job import check_resumable, open_resume_state, resume_identity
from .config import FlattenConfig
from .export.checkpoint import COMPRESSED_FROM
from .export.provenance import base_license, drop_own_quantization_config, set_name_or_path, source_name_or_path
from .plan import LayerPlan
from .registry import get_method_class, registered_methods, require_capabilities
from .report import CompressionReport, check_describes
from .utils.causal_lm import check_causal_lm
from .utils.fingerprint import weights_fingerprint
from .utils.launch import is_writer, process_group
from .utils.loading import public_base_name, public_dataset_name
from .utils.positions import check_sequence_length
from .utils.torch_utils import count_parameters, synchronize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What `FlattenQuantizer.preflight` checked and resolved: everything the run needs, no weight changed yet."""

    adapter: ArchitectureAdapter
    method: CompressionMethod
    #: The stack the method plans on.
    stack: str
    corrections: Corrections
    #: Layers of that stack before.
    num_layers: int
    num_to_remove: int
    #: The calibration batches (none for a method that needs no calibration): this rank's share under a process
    #: group of several ranks (calibration/distributed.py).
    batches: list[Any]
    #: The ranks the calibration is sharded over (1: one process, every batch here).
    world_size: int = 1
    #: The job's per-layer state (``FlattenConfig(resume_dir=...)``), checked against this job; None without one.
    resume: ResumeState | None = None
    #: ``FlattenConfig(heal=...)``'s (training text, its column, RecoveryConfig with the mode resolved, how it was
    #: chosen); None without.
    heal: tuple[Any, str, Any, str] | None = None
    #: The sampling record of the model's own calibration rows (`CalibrationConfig.own_text`); None without.
    own_text: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Run:
    plan: LayerPlan
    context: MethodContext
    params_before: int
    stack_weights: int
    #: The checkpoint the model was loaded from, read before the run cleared it.
    source_name: str
    #: Real-token masks of the calibration batches.
    masks: list[torch.Tensor]
    #: `weights_fingerprint` of the model before the run changed it.
    source_fingerprint: str
    #: FLOPs of one forward of the original stack over the calibration batches (`utils.flops.dense_forward_flops`).
    dense_forward_flops: float = 0.0


class FlattenQuantizer(OptimumQuantizer):
    """Compresses a model's depth in place, as the `FlattenConfig` says.

    Example:
        >>> quantizer = FlattenQuantizer(FlattenConfig(num_layers_to_remove=6, dataset=texts, nsamples=32))
        >>> model = quantizer.compress(model, tokenizer)
        >>> quantizer.save(model, "out", tokenizer)

    It also follows optimum's quantizer contract, like `ORTQuantizer`:
        >>> quantizer = FlattenQuantizer.from_pretrained("path/to/model")
        >>> quantizer.quantize(save_dir="out", quantization_config=FlattenConfig(num_layers_to_remove=6, ...))

    Every check that can fail (architecture, capabilities, target, calibration data) runs before any weight is
    touched, so a refused request leaves the model as it was.
    """

    def __init__(
        self,
        config: FlattenConfig | None = None,
        progress: bool = True,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        if config is not None and not isinstance(config, FlattenConfig):
            raise TypeError(f"FlattenQuantizer needs a FlattenConfig, got {type(config).__name__}.")
        self.config = config
        self.progress = progress
        self.model = model
        self.tokenizer = tokenizer
        #: The last compression's record (empty before the first).
        self.report: CompressionReport | dict[str, Any] = {}
        self.plan: LayerPlan | None = None
        #: Whether the caller keeps the model it passed, whatever `compress` returns (compress-on-load): a healing
        #: sharded by FSDP2, which rank 0 gets back as another object, is then refused before any work.
        self.in_place = False
        self._changing: nn.Module | None = None  # the model `compress` last went past its preflight with
        self._bound_compressed = False  # whether `quantize` changed the bound model (then it refuses a second call)

    @classmethod
    def from_pretrained(
        cls, model_or_path: str | Path | nn.Module, file_name: str | None = None, tokenizer: Any = None, **kwargs: Any
    ) -> FlattenQuantizer:
        """A quantizer bound to a model (loaded from a checkpoint path or name, or given), as optimum's are.

        Args:
            model_or_path: A checkpoint directory or Hub name, or a loaded model.
            file_name: Unused (optimum's ONNX quantizers pick a file with it); must be None.
            tokenizer: The calibration tokenizer; loaded from `model_or_path` when it is a path and this is None.
            **kwargs: Passed to `from_pretrained` of the checkpoint's own class (``config.architectures``), e.g.
                ``dtype``, ``device_map``.
        """
        if file_name is not None:
            raise ValueError(f"file_name is for ONNX models and has no meaning here, got {file_name!r}.")
        if isinstance(model_or_path, nn.Module):
            return cls(model=model_or_path, tokenizer=tokenizer)
        from .utils.loading import load_pretrained, load_processor

        model = load_pretrained(model_or_path, **kwargs)
        remote = bool(kwargs.get("trust_remote_code", False))
        return cls(model=model, tokenizer=tokenizer or load_processor(model_or_path, trust_remote_code=remote))

    def quantize(
        self,
        save_dir: str | Path,
        file_prefix: str | None = None,
        quantization_config: FlattenConfig | None = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> Path:
        """Compresses the bound model and saves the plain checkpoint to `save_dir` (optimum's entry point).

        Args:
            save_dir: Output directory (must be empty or absent unless `overwrite`).
            file_prefix: Unused (optimum's ONNX quantizers prefix file names with it); must be None.
            quantization_config: The FlattenConfig; defaults to the one given at construction.
            overwrite: Replace a non-empty `save_dir`.
        """
        if file_prefix is not None:
            raise ValueError(f"file_prefix is for ONNX models and has no meaning here, got {file_prefix!r}.")
        if kwargs:
            raise TypeError(f"quantize got unexpected arguments {sorted(kwargs)}.")
        if self.model is None:
            raise ValueError("no model is bound: create the quantizer with FlattenQuantizer.from_pretrained(...).")
        if isinstance(quantization_config, Mapping):  # as from_pretrained(quantization_config=) takes one
            quantization_config = FlattenConfig.from_dict(quantization_config)
        if quantization_config is not None and not isinstance(quantization_config, FlattenConfig):
            raise TypeError(f"quantize needs a FlattenConfig, got {type(quantization_config).__name__}.")
        if quantization_config is not None:
            self.config = quantization_config
        if self.config is None:
            raise ValueError("no FlattenConfig: pass quantize(quantization_config=...) or FlattenQuantizer(config).")
        from .export.checkpoint import _model_sources, check_output_dir
        from .utils.state_folders import check_heal_folders, check_state_folder

        # The same refusals `save` applies (the model's own folder, the current or a home folder, write access), up
        # front: a refused output found after the compression would waste it; so would a healing's state folder
        # inside it, which the save would find there.
        sources = _model_sources(self.model)
        check_output_dir(save_dir, overwrite, sources=sources)
        check_heal_folders(str(save_dir), self.config.heal, sources)
        check_state_folder(str(save_dir), self.config.resume_dir, "resume_dir", sources)
        if self._bound_compressed:
            # optimum's quantizers read their model again on every call; this one compresses the bound model in
            # place, so a second call (a retry after a refusal, a sweep of configs) would compress it again.
            raise ValueError(
                "quantize() already compressed this quantizer's model (in place): bind the dense model again with "
                "FlattenQuantizer.from_pretrained(...) to start from it, or compress the compressed model on purpose "
                "with FlattenQuantizer(config).compress(model, tokenizer)."
            )
        bound = self.model
        try:
            self.model = self.compress(bound, self.tokenizer)  # whole on rank 0 after a sharded healing
        finally:  # past the preflight the bound model is changed, whether the rest succeeded or not
            self._bound_compressed = self._changing is bound
        return self.save(self.model, save_dir, self.tokenizer, overwrite=overwrite)

    def _stack(self, adapter: ArchitectureAdapter, method: CompressionMethod) -> str:
        """The stack the method plans on: the last of those it compresses (`CompressionMethod.stacks_to_compress`
        decides how many; a method that changes every stack itself reports its identity plan on the last one)."""
        stacks = self.config.stacks or adapter.stacks()
        unknown = [s for s in stacks if s not in adapter.stacks()]
        if unknown:
            raise ValueError(f"stacks {unknown} do not exist in this model; it has {adapter.stacks()}.")
        return method.stacks_to_compress(adapter, list(stacks))[-1]

    def compress(self, model: nn.Module, tokenizer: Any = None) -> nn.Module:
        """Compresses `model` in place and returns it; `self.report` then holds what was done and measured. After a
        healing FSDP2 sharded across the ranks, rank 0 gets another model back, whole (`recovery.unsharded`): save
        the model this returns.

        Three stages: `preflight` (every refusal, before any weight changes), the run (calibrate, plan, apply),
        and the report (a `CompressionReport`).

        Raises:
            UnsupportedArchitectureError: no adapter, or the adapter lacks what the method needs.
            InvalidTargetError: the target removes no layer or every layer.
            CalibrationDataError: missing tokenizer, unreadable or too little calibration text.
        """
        start = time.perf_counter()
        checked = self.preflight(model, tokenizer)
        self._changing = model  # from here on its weights change (`quantize` will not compress it twice)
        # With heal=..., the dense weights are the teacher: a copy is taken before the first weight changes.
        teacher = self._dense_copy(model) if self.config.heal else None
        run = self._run(model, checked)
        self.plan = run.plan
        self.config.layer_plan = run.plan.to_dict()
        self.report = self._report(model, checked, run, start)
        if teacher is not None:
            model = self._heal(model, tokenizer if tokenizer is not None else self.config.tokenizer, teacher, checked)
        return model

    def _heal_inputs(self, model: nn.Module) -> tuple[Any, str, Any, str]:
        """(training text, its column, RecoveryConfig, how its mode was chosen) of `FlattenConfig.heal` (default
        text: the calibration's), its mode resolved on the dense `model` before any change: `full` by default where
        its memory fits beside the teacher copy still to be taken (the dense model, an upper bound of the student it
        will train)."""
        from .options.recovery import HEAL_EXTRA_KEYS, RecoveryConfig
        from .recovery.mode import compress_heal_mode
        from .recovery.rows import teacher_share
        from .recovery.teacher_text import is_teacher_dataset

        heal = dict(self.config.heal or {})
        dataset = heal.get("dataset") if heal.get("dataset") is not None else self.config.calibration.dataset
        column = heal.get("text_column", self.config.calibration.text_column)
        settings = {k: v for k, v in heal.items() if k not in HEAL_EXTRA_KEYS}
        config = RecoveryConfig(**settings)  # the dense model teaches; the compression about to run gives the plan
        if is_teacher_dataset(dataset):  # the teacher's text only: the footprint counts its sampling, as recover's
            config = dataclasses.replace(config, teacher_text=teacher_share(dataset, config))
        config, choice = compress_heal_mode(model, config)  # the check `estimate --heal` makes too
        return dataset, column, config, choice.describe()

    @staticmethod
    def _dense_copy(model: nn.Module) -> nn.Module:
        """A frozen copy of the dense model, the healing's teacher (one more model's worth of memory while the
        compression and the healing run; freed when they end)."""
        import copy

        teacher = copy.deepcopy(model).eval()
        teacher.requires_grad_(False)
        return teacher

    def _heal(self, model: nn.Module, tokenizer: Any, teacher: nn.Module, checked: Preflight) -> nn.Module:
        """Distils the compressed `model` from `teacher` (`recovery.recover`) and records it in the report."""
        import dataclasses

        from .options.recovery import SPLIT_AFTER_MERGES, local_then_global, merges_layers
        from .recovery import recover
        from .recovery.arguments import fsdp_version
        from .recovery.unsharded import cpu_copy, unsharded_for_save
        from .utils.launch import launched_rank

        dataset, column, config, chosen = checked.heal
        # The plan is known now: a default `full` after a plan that merged layers trains locally, then globally, on
        # one process (`local` cannot run across ranks: under a launcher of several, `full` stays, as `with_mode`).
        one_process = process_group()[1] == 1
        merged = merges_layers(self.plan.to_dict())
        if chosen.startswith("the default") and fsdp_version(config) is None and merged and one_process:
            resolved = local_then_global(config)
            if resolved is not config:
                config = resolved
                chosen += f"; {SPLIT_AFTER_MERGES}"
        if config.mode == "changed" and (nothing := self._nothing_changed(model)):  # known only now, from the plan
            return self._skip_healing(model, config.mode, nothing)
        # Under FSDP2 the healing leaves the model sharded across the ranks: rank 0 keeps a plain CPU copy to gather
        # the trained weights into (`recovery.unsharded`), since the save writes one whole model.
        spare = cpu_copy(model) if fsdp_version(config) is not None and launched_rank() == 0 else None
        start = time.perf_counter()
        healed, log = recover(
            model, tokenizer, dataset, config, text_column=column, teacher=teacher, report=self.report
        )
        healed = unsharded_for_save(healed, lambda: spare)
        synchronize()
        seconds = round(time.perf_counter() - start, 3)
        # The mode was chosen before the compression, on the dense model: say how, not recover's "given".
        log = {**log, "mode_chosen": chosen, "dataset": public_dataset_name(dataset), "seconds": seconds}
        # Not a method entry, but the report's flat view is where the card and `recover` write "recovery" too.
        self.report = dataclasses.replace(self.report, method_entries={**self.report.method_entries, "recovery": log})
        return healed

    def _nothing_changed(self, model: nn.Module) -> str | None:
        """Why mode 'changed' has nothing to train after this plan (a ShortGPT plan that dropped the first layers,
        which no bridge can cover), or None."""
        from .recovery.selection import changed_parameter_names

        try:
            changed_parameter_names(model, self.report)
        except ValueError as error:
            return str(error)
        return None

    def _skip_healing(self, model: nn.Module, mode: str, reason: str) -> nn.Module:
        """Keeps the compressed model unhealed, with a warning and a report entry, rather than raise after the
        compression: the command line would then save nothing, losing the compression for a healing option."""
        import warnings

        message = (
            f"the healing was skipped and the model kept as compressed: {reason} "
            "(heal the saved checkpoint with `optimum-flatten recover` and another --mode)"
        )
        warnings.warn(message, stacklevel=3)
        entry = {"skipped": message, "mode": mode}
        self.report = dataclasses.replace(self.report, method_entries={**self.report.method_entries, "recovery": entry})
        return model

    def preflight(self, model: nn.Module, tokenizer: Any = None) -> Preflight:
        """Every check `compress` makes before it touches a weight, and what they resolved (nothing is changed).

        A refused request raises here, so `compress` never leaves a half-compressed model; callers can also use
        it as a dry run (the calibration batches are built, so a bad dataset or tokenizer is refused too).
        """
        if self.config is None:
            raise ValueError(
                "no FlattenConfig: pass one to FlattenQuantizer(config) or to quantize(quantization_config=)."
            )
        adapter = get_adapter(model)
        method_class = get_method_class(self.config.method)
        method = method_class(self.config.method_config)
        stack = self._stack(adapter, method)
        require_capabilities(adapter, self.config.method, stack)
        corrections = Corrections(
            self.config.linear_replacement, self.config.compensation, seed=self.config.calibration.seed
        )
        pipeline.preflight(adapter, method, stack, corrections)
        if self.config.resume_dir is not None:
            check_resumable(method, corrections)
        num_layers = adapter.num_layers(stack)
        # A depth-keeping method must plan the identity; it reports what it changed in `context.report`.
        num_to_remove = 0 if method_class.keeps_depth else self.config.resolve_num_layers_to_remove(num_layers)
        if num_to_remove:
            # before the calibration, and any own rows, are made
            method.check_target(num_layers, num_to_remove, adapter.layer_kind_rule(stack))
        tokenizer = tokenizer if tokenizer is not None else self.config.tokenizer
        if method.requires_calibration:  # the data's kind; a sequence past a position table, or RoPE's trained length
            check_data_kind(model, adapter.calibrates_on, self.config.calibration)
            check_sequence_length(model, self.config.calibration.seqlen)
        own_text = method.requires_calibration and self.config.calibration.own_text > 0
        if own_text:  # a model that writes no text is refused now, in one line
            from .recovery.own_calibration import check_own_text

            check_own_text(model, tokenizer, self.config.calibration)
        rank, world_size = process_group()
        processes = world_size  # `world_size` below: the ranks that share the calibration
        if self.config.resume_dir is not None and world_size > 1:
            raise ValueError("resume_dir keeps one process's state; run a resumable compression in one process.")
        if world_size > 1 and method.requires_calibration:
            check_shardable(method, corrections, rank, world_size)
        heal = None
        if self.config.heal:
            from .recovery.heal_request import check_heal_request

            check_causal_lm(model)  # healing would refuse it after the compression, whose work would be lost
            heal = self._heal_inputs(model)
            kept = num_layers - num_to_remove
            check_heal_request(model, tokenizer, heal, method, corrections, kept, processes, in_place=self.in_place)
        batches, own_record = (
            self._calibration_batches(model, tokenizer, (stack, num_layers, num_to_remove), own_text)
            if method.requires_calibration
            else ([], None)
        )
        if world_size > 1 and len(batches) >= world_size:
            share = shard_range(len(batches), rank, world_size)
            batches = batches[share.start : share.stop]
        else:
            if world_size > 1 and batches:
                # Nothing to share out: every rank calibrates on every batch, as one process would (no collective).
                logger.info(
                    "%d calibration batches for %d processes: every rank calibrates on all of them",
                    len(batches),
                    world_size,
                )
            world_size = 1
        resume = None
        if self.config.resume_dir is not None:
            resume = open_resume_state(self.config, model, stack, num_layers, num_to_remove, batches)
        return Preflight(
            adapter, method, stack, corrections, num_layers, num_to_remove, batches, world_size, resume, heal,
            own_record,
        )  # fmt: skip

    def _calibration_batches(
        self, model: nn.Module, tokenizer: Any, job: tuple[str, int, int], own_text: bool
    ) -> tuple[list[Any], dict[str, Any] | None]:
        """The calibration batches and, with ``own_text``, the record of the model's own rows. Everything that can
        refuse comes before the model writes a row (hours at 7B): the dataset's share of the rows is drawn first (too
        little text), and a `resume_dir` is checked against this job but for its calibration (a file, another job's
        folder, another share), since the rows are kept there."""
        calibration = self.config.calibration
        if is_image_dataset(calibration.dataset, calibration.text_column):
            return build_image_batches(tokenizer, calibration), None
        drawn = draw_dataset_rows(tokenizer, calibration)
        own_rows, own_record = None, None
        if own_text:
            from .recovery.own_calibration import sample_own_rows

            if self.config.resume_dir is not None:
                ResumeState.check(self.config.resume_dir, resume_identity(self.config, model, *job, batches=None))
            own_rows, own_record = sample_own_rows(model, tokenizer, calibration, self.config.resume_dir, self.progress)
        return batches_of(drawn, calibration, own_rows), own_record

    def _run(self, model: nn.Module, checked: Preflight) -> _Run:
        """Calibrates, plans and applies the method; then the model no longer names the checkpoint it came from."""
        adapter, stack = checked.adapter, checked.stack
        params_before = count_parameters(model)
        fingerprint = weights_fingerprint(model)  # of the dense weights: what a healing teacher is checked against
        stack_weights = count_parameters(adapter.layers(stack))
        # Real positions per batch, as the adapter defines them on the original stack (read before it changes).
        masks = [adapter.token_mask(stack, b) for b in checked.batches]
        dense_flops = dense_forward_flops_of(adapter, stack, stack_weights, masks)
        context = MethodContext(batches=checked.batches, stack=stack, progress=self.progress, resume=checked.resume)
        if checked.resume is not None:
            checked.resume.begin(context)  # what this attempt spends, added to the earlier ones' in the folder
        was_training = model.training
        model.eval()
        with torch.no_grad(), sharded_calibration(checked.world_size):
            plan = pipeline.plan_and_apply_(
                adapter, checked.method, context, checked.num_to_remove, checked.corrections
            )
        model.train(was_training)
        drop_own_quantization_config(model)
        source_name = source_name_or_path(model)
        # The model no longer is the checkpoint it was loaded from: a LoRA adapter trained on it must not record
        # that checkpoint as its base. `save` points it at the saved directory.
        set_name_or_path(model, "")
        if source_name:  # still never written over (`export.checkpoint.COMPRESSED_FROM`)
            setattr(model, COMPRESSED_FROM, source_name)
        return _Run(plan, context, params_before, stack_weights, source_name, masks, fingerprint, dense_flops)

    def _report(self, model: nn.Module, checked: Preflight, run: _Run, start: float) -> CompressionReport:
        """The record of what was done and measured (the method's entries beside the core fields)."""
        base_name, base_on_hub = public_base_name(run.source_name)
        masks = run.masks
        synchronize()  # so that total_seconds counts the GPU work, not its launch
        calibration = self.config.calibration
        with sharded_calibration(checked.world_size):  # the tokens of every rank's share
            (tokens,) = all_reduce_sums(sum(int(m.sum()) for m in masks))
        before = checked.resume.before if checked.resume is not None else {"seconds": 0.0, "work": 0}
        positions = sum(int(m.numel()) for m in masks)  # the unit of the stack passes, as `compute_cost` counts
        cost = compute_cost(
            run.context, run.stack_weights, positions, run.dense_forward_flops, before["work"], checked.world_size
        )
        entries = dict(run.context.report)
        if before["seconds"]:  # resumed: the seconds and stack passes count the earlier attempts' kept work too
            entries["resumed"] = {
                "seconds_before": before["seconds"],
                "stack_passes_before": round(before["work"] / (run.stack_weights * positions), 3) if positions else 0.0,
                "arithmetic": "this attempt's only",
            }
        return CompressionReport(
            method=self.config.method,
            method_args=self.config.method_args,
            model_type=model.config.model_type,
            base_model=base_name,
            base_model_on_hub=base_on_hub,
            license=base_license(run.source_name),
            architecture=type(model).__name__,
            plan=run.plan.to_dict(),
            plan_summary=run.plan.describe(),
            num_layers_before=checked.num_layers,
            num_layers_after=checked.adapter.num_layers(checked.stack),
            parameters_before=run.params_before,
            parameters_after=count_parameters(model),
            calibration={
                "dataset": public_dataset_name(calibration.dataset),
                "nsamples": calibration.nsamples,
                "seqlen": calibration.seqlen,
                "seed": calibration.seed,
                "packing": calibration.packing,
                "tokens": int(tokens),  # real positions (text tokens, or CLS and patches), as the adapter counts them
                **({"inputs": "images"} if checked.adapter.calibrates_on == "images" else {}),
                **({"processes": checked.world_size} if checked.world_size > 1 else {}),
                **({"own_text": checked.own_text} if checked.own_text else {}),
            },
            timings_seconds={k: round(v, 3) for k, v in run.context.timings.items()},
            cost=cost,
            total_seconds=round(time.perf_counter() - start + before["seconds"], 3),
            source_fingerprint=run.source_fingerprint,
            method_entries=entries,
        )

    def _report_of(self, model: nn.Module) -> dict[str, Any]:
        """This quantizer's report, or the one a compression on load left on the model (``from_pretrained(...,
        quantization_config=FlattenConfig(...))`` compresses with a quantizer of its own): a fresh quantizer saving
        that model wrote an empty report and a card of question marks, and `recover` then found no plan."""
        return check_describes(model, self.report or getattr(model, "flatten_report", None) or {})

    def save(
        self,
        model: nn.Module,
        output_dir: str | Path,
        tokenizer: Any = None,
        overwrite: bool = False,
        extra_report: dict[str, Any] | None = None,
    ) -> Path:
        """Writes a plain checkpoint (weights, config, tokenizer), flatten_report.json, a model card and a heatmap.

        The directory is written next to its destination and renamed into place, so an interrupted save leaves
        no half-written directory. Refuses a non-empty `output_dir` unless `overwrite`.

        Under a process group only rank 0 writes (every rank holds the same model after a sharded calibration); the
        others return the path at once, without waiting (a caller that saves on rank 0 alone must not hang).
        """
        from .export.checkpoint import save_compressed

        if not is_writer():
            return Path(output_dir)
        _refuse_sharded(model)
        report = {**self._report_of(model), **(extra_report or {})}
        return save_compressed(model, output_dir, tokenizer=tokenizer, report=report, overwrite=overwrite)

    def push_to_hub(
        self,
        model: nn.Module,
        repo_id: str,
        tokenizer: Any = None,
        local_dir: str | Path | None = None,
        extra_report: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Saves the plain checkpoint locally (see `save`), then uploads it to `repo_id` on the Hub.

        Under a process group only rank 0 saves and uploads (every rank holds the same model after a sharded
        calibration: N uploads of one checkpoint would race on one repo); the others return `repo_id` at once.

        Raises:
            ValueError: before anything is written, on every rank, for a repo id the Hub rejects or in
                huggingface_hub's offline mode (`export.hub.check_hub_repo`).
            HubUploadError: when the upload fails; the local folder stays, and the message says where it is.
        """
        from .export.hub import check_hub_repo, push_to_hub

        # On every rank, so that all of them refuse together rather than rank 0 alone after its save.
        check_hub_repo(repo_id, kwargs.get("api"))
        if not is_writer():
            return repo_id
        _refuse_sharded(model)
        report = {**self._report_of(model), **(extra_report or {})}
        return push_to_hub(model, repo_id, tokenizer=tokenizer, report=report, local_dir=local_dir, **kwargs)


def _refuse_sharded(model: nn.Module) -> None:
    """Refuses a model FSDP2 left sharded across the ranks: each holds a shard, and the save would write shards."""
    from .recovery.unsharded import is_sharded

    if is_sharded(model):
        raise ValueError(
            "this model's parameters are FSDP2 shards (a healing sharded it across the processes): save the model "
            "`compress` returned, whole on rank 0, or gather it with recovery.unsharded.unsharded_for_save first."
        )


def check_shardable(method: CompressionMethod, corrections: Corrections, rank: int, world_size: int) -> None:
    """Refuses, before any work, a compression that cannot calibrate across `world_size` ranks.

    Raises:
        ValueError: a method (or an option, or a correction) whose statistics are not summed over the ranks.
    """
    where = f"this process is rank {rank} of {world_size} (torchrun / accelerate launch)"
    one_process = "run the compression in one process (python, not torchrun or accelerate launch)"
    if not method.shards_calibration:
        covered = [name for name in registered_methods() if get_method_class(name).shards_calibration]
        raise ValueError(
            f"method {method.name!r} cannot calibrate across processes: {where}, and only {covered} sum their "
            f"calibration statistics over the ranks. Use one of those, or {one_process}."
        )
    refusal = method.sharding_refusal()
    if refusal is None and corrections.compensation is not None:
        refusal = f"compensation={corrections.compensation!r} measures its scales on one process's states"
    if refusal is None and corrections.linear_replacement == "cosine":
        refusal = "linear_replacement='cosine' runs Adam over the tokens themselves (use 'lstsq')"
    if refusal is not None:
        raise ValueError(
            f"{method.name!r} cannot calibrate across processes as configured: {where}, and {refusal}; "
            f"or {one_process}."
        )
