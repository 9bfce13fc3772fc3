"""The method contract: declare what you need, plan without touching weights, then apply through the adapter."""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..adapters.base import ArchitectureAdapter
from ..calibration.capture import LayerwiseRunner
from ..calibration.data import CalibrationBatch
from ..calibration.states import CalibratedStates
from ..config import MethodConfig
from ..plan import LayerPlan
from ..utils.flops import ArithmeticCount
from ..utils.torch_utils import synchronize
from .compute import ComputeModel
from .resume import ResumeState
from .workspace import WorkspaceModel, WorkspaceSizes

logger = logging.getLogger(__name__)


@dataclass
class MethodContext:
    """What a method gets besides the adapter: calibration batches, timers, progress and the report it fills."""

    batches: Sequence[CalibrationBatch]
    stack: str = "decoder"
    progress: bool = True
    report: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    #: Weight x token products spent outside the block runners (e.g. LM-head evaluations); see `work`.
    extra_work: int = 0
    #: The compensation requested with this method (``"scale"`` or None), for a method whose own loop measures it.
    compensation: str | None = None
    #: Compensation factors a method measured in its own loop (dropped layer -> α), used by the fold instead of a
    #: fresh bottom-up measurement (Prune&Comp measures each α right after its drop, in drop order).
    measured_scales: dict[int, float] | None = None
    #: The method's own arithmetic (moments, solves, factorisations) per timed phase, counted by the ops that do it
    #: (`utils.flops`): the compute the stack passes do not show.
    arithmetic: ArithmeticCount = field(default_factory=ArithmeticCount)
    #: The job's per-layer state (``FlattenConfig(resume_dir=...)``), for a method whose `resume_refusal` is None:
    #: it installs the groups saved there instead of recomputing them and saves each group it finishes.
    resume: ResumeState | None = None
    _runners: list[LayerwiseRunner] = field(default_factory=list)

    def new_runner(self, adapter: ArchitectureAdapter) -> LayerwiseRunner:
        """A fresh block runner positioned at the input of layer 0 (costs one embedding pass)."""
        with self.timer("capture"):
            runner = LayerwiseRunner(adapter, self.batches, self.stack)
        self._runners.append(runner)
        return runner

    def new_states(self, adapter: ArchitectureAdapter, keep: Iterable[int] | None = None) -> CalibratedStates:
        """The states engine over a fresh runner: layer-boundary states of the stack, cached as `keep` allows."""
        return CalibratedStates(self.new_runner(adapter), adapter.layers(self.stack), keep)

    def states_of_unchanged_model(
        self, adapter: ArchitectureAdapter, keep: Iterable[int] | None = None
    ) -> CalibratedStates:
        """The states engine over this context's latest runner when it can stand for a fresh one, else a fresh one.

        A runner holds the layer-0 states and every layer's call arguments of the model as it was when recorded, so
        it stands for a fresh one only while the model is unchanged: the caller vouches for that (a method's
        `apply_`, or the correction around it, before its first change; `plan` is a pure decision). Checked here:
        the runner was recorded through this adapter, on this stack as long as it is now, over every calibration
        batch (a search may have cut its runner down to its scoring batches). Reusing it saves a copy of the
        calibration states (S) and an embedding pass.
        """
        latest = self._runners[-1] if self._runners else None
        if (
            latest is not None
            and latest.adapter is adapter
            and latest.stack == self.stack
            and latest.num_batches == len(self.batches)
            and len(latest.layer_kwargs) == adapter.num_layers(self.stack)
        ):
            return CalibratedStates(latest, adapter.layers(self.stack), keep)
        return self.new_states(adapter, keep)

    @property
    def work(self) -> int:
        """Weight x token products of every block run and counted extra: compute in a machine-free unit."""
        return sum(r.work for r in self._runners) + self.extra_work

    @contextlib.contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Adds the wall time of the block to `timings[phase]` (phases nest; each is timed on its own).

        The accelerator is synchronised at both ends: without it a GPU phase would be timed by its kernel launches.
        The arithmetic the ops record meanwhile is counted under the same phase (`arithmetic`).
        """
        synchronize()
        start = time.perf_counter()
        try:
            with self.arithmetic.phase(phase):
                yield
        finally:
            synchronize()
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start

    def progress_bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, disable=not self.progress, leave=False)


@dataclass(frozen=True)
class CheckpointWriter:
    """How to write a model that a method left in a state the stock ``save_pretrained`` cannot describe.

    The writer is the method's own function (a method that writes checkpoints keeps its writer in its package, as
    LayerCollapse does), so the exporter calls it without knowing the method: ``function(model, directory,
    **save_kwargs)``, returning the format it wrote (the report's ``export_format``).
    """

    #: The writer.
    function: Callable[..., str]
    #: Entries the saved report gets (what the checkpoint holds that the stock config does not say).
    report: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerMatrixFigure:
    """A layer x layer matrix the checkpoint shows as a heatmap, with the plan's groups outlined.

    A method gives the data and the file name; the exporter draws it (the plotting code sits above the methods) and
    the card shows it under `caption`, so neither names the method nor its report keys.
    """

    #: The PNG written into the checkpoint folder; list it in the method's `checkpoint_files` too.
    file_name: str
    caption: str
    #: Rows of values; None where a band limit left an entry uncomputed.
    matrix: Sequence[Sequence[float | None]]
    #: Groups of original layer indices to outline (merged groups), or None.
    groups: Sequence[Sequence[int]] | None = None
    #: What a cell's value is, for the colour bar.
    value_label: str = "value"


@dataclass(frozen=True)
class CardSection:
    """What a method contributes to the model card, each part optional; the card itself names no method."""

    #: Replaces the generic opening paragraph ("an ordinary checkpoint with N layers instead of M").
    summary: str | None = None
    #: Markdown list items under "What was done".
    lines: tuple[str, ...] = ()
    #: Replaces the generic "before -> after" parameter text (card and CLI summary).
    parameters: str | None = None
    #: Heatmaps written beside the checkpoint and shown on the card.
    figures: tuple[LayerMatrixFigure, ...] = ()
    #: Warnings the run recorded that a user must see (the CLI prints them after compressing).
    warnings: tuple[str, ...] = ()


class CompressionMethod(ABC):
    """A depth-compression method.

    Lifecycle (driven by FlattenQuantizer): `plan` decides from calibration statistics which layers to keep,
    merge or drop and returns a LayerPlan without touching weights; `apply_` changes weights and blocks through
    the adapter's mutators only. The quantizer then renumbers layers, updates the config and validates.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[MethodConfig]]
    requires_calibration: ClassVar[bool] = True
    required_capabilities: ClassVar[frozenset[str]] = frozenset()
    #: A method that changes weights but no layer count (ffn_merge shares parameters between layers): its target
    #: comes from its own options, `num_layers_to_remove`/`target_sparsity` are refused, and its plan is the identity.
    keeps_depth: ClassVar[bool] = False
    #: Whether `FlattenConfig(linear_replacement=...)` may bridge this method's removed spans (a method that fits its
    #: own replacement, or keeps depth, says no).
    accepts_linear_replacement: ClassVar[bool] = True
    #: True for methods whose plans merge layers (FlattenGPT, LaCo, SWM): a correction defined for dropped layers
    #: (compensation="scale") is refused for them before calibration.
    merges_layers: ClassVar[bool] = False

    #: Whether ``from_pretrained(..., quantization_config=FlattenConfig(method=...))`` may run this method. A method
    #: whose result needs more than ``save_pretrained`` (or a step between loading and compressing) says no, and
    #: `compress_on_load_refusal` tells the user what to do instead.
    supports_compress_on_load: ClassVar[bool] = True
    #: Why compress-on-load is refused and what to run instead (shown after "cannot run inside from_pretrained: ").
    compress_on_load_refusal: ClassVar[str] = ""
    #: The option that lets this method change several stacks in one compression, as the one-stack refusal
    #: suggests it (e.g. ``"sync_stacks=True to ..."``); None for a method that compresses one stack.
    multi_stack_option: ClassVar[str | None] = None
    #: File patterns this method's `checkpoint_writer` adds to a checkpoint folder (beside transformers' files), so
    #: that a save over an existing checkpoint replaces or removes them like the rest of the checkpoint.
    checkpoint_files: ClassVar[tuple[str, ...]] = ()
    #: Whether the method calibrates across ranks (calibration/distributed.py): under torchrun or accelerate launch
    #: each rank takes its share of the batches and every statistic the method uses is summed over the ranks where
    #: it is complete. A method that says no is refused under a process group of more than one rank.
    shards_calibration: ClassVar[bool] = False
    #: Whether the method reads each MLP's up and down projections (FlattenGPT prunes their channels, ffn_merge
    #: shares them): an MLP LayerCollapse made one linear map has none, and such a model is refused before any
    #: change (`compression.pipeline.preflight`), where the method would fail half-way through its changes.
    reads_mlp_projections: ClassVar[bool] = False

    def __init__(self, config: MethodConfig) -> None:
        self.config = config

    def planning_batches(self) -> int | None:
        """How many leading calibration batches `plan` reads, where that is all it reads and the plan is all it
        leaves for `apply_` (None: every batch, or not known). `auto` reuses a winner's scored plan instead of
        planning again when the batches it scored on hold those: the same plan from the same batches, without the
        search's cost a second time."""
        return None

    def sharding_refusal(self) -> str | None:
        """Why this configuration of a method that `shards_calibration` cannot (an option whose statistics are not
        summed over the ranks), or None when it can."""
        return None

    def resume_refusal(self) -> str | None:
        """Why this configuration cannot keep per-layer state (``FlattenConfig(resume_dir=...)``), or None when
        its `apply_` installs the groups saved in `MethodContext.resume` and saves each one it finishes.

        The default refuses: the pipeline resumes the plan for any method, but the groups only a method can save.
        """
        return f"method {self.name!r} keeps no per-layer state (resume_dir is supported by flattengpt)"

    def stacks_to_compress(self, adapter: ArchitectureAdapter, requested: Sequence[str]) -> list[str]:
        """The stacks this compression changes, from the `requested` ones (``FlattenConfig.stacks``, else every
        stack of the model; the quantizer has checked that they exist). The quantizer plans on the last one.

        The default compresses exactly one stack. A method that changes several stacks itself overrides this, so
        the driver holds no method's stack policy.

        Raises:
            ValueError: more than one stack requested, naming the methods that can take several.
        """
        if len(requested) != 1:
            raise ValueError(
                f"this version compresses one stack at a time, got stacks={list(requested)} (every stack of the "
                f"model when none is named); pass one of them with stacks= / --stacks{_multi_stack_hint()}."
            )
        return [requested[0]]

    @classmethod
    def checkpoint_writer(cls, model: Any) -> CheckpointWriter | None:
        """The writer for `model` when it carries this method's changes in a form ``save_pretrained`` cannot
        describe; None (the default) when a plain ``save_pretrained`` writes it.

        Asked of every registered method at save time, since the state lives in the model, whichever method's
        report is being saved.
        """
        return None

    @classmethod
    def adopt_reloaded_(cls, model: Any) -> list[str]:
        """Puts back, in a model reloaded from this method's remote-code checkpoint, the modules its in-memory form
        has (the modelling file may import only torch and transformers, so it holds look-alikes); returns the
        module paths changed. The default, and any method for a model that is not its own, changes nothing.

        Asked of every registered method by `get_adapter` when the model is a ``"<stock>_<variant>"`` remote-code
        variant of a stock family, so that the adapters, below the methods, name none.
        """
        return []

    @classmethod
    def card_lines(cls, report: dict[str, Any]) -> list[str]:
        """Markdown list items the model card adds under "What was done" for this method (default: none).

        The shorthand of `card_section` for a method that adds list items only.
        """
        return []

    @classmethod
    def card_section(cls, report: dict[str, Any]) -> CardSection | None:
        """This method's part of the model card for `report`, or None when the report carries none of its entries.

        The card asks every registered method (the report's own first), so each one answers only from the entries
        it writes. The default wraps `card_lines`.
        """
        lines = tuple(cls.card_lines(report))
        return CardSection(lines=lines) if lines else None

    @classmethod
    def workspace(cls, z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel | None:
        """The method's memory model for `optimum-flatten estimate` removing `n` layers: the phases it times with
        the terms each holds at its peak, the stack passes, whether those are a bound, and notes (see
        `compression.workspace` and `optimum_flatten.estimate`). None (the default): the method has none, and the
        estimate refuses it, naming the methods that have one.
        """
        return None

    @classmethod
    def keeps_runner_states(cls, config: Any) -> bool:
        """Whether the runner the method's planning opened still holds its layer-0 states (a copy of the calibration
        states) while a correction runs after it: the context keeps every runner, and the correction's memory model
        (`compression.correction_workspace`) counts that copy unless the method released it. True (the default)
        unless the method's walk releases them (`CalibratedStates.release_layer_zero`)."""
        return True

    @classmethod
    def measures_compensation(cls, config: Any) -> bool:
        """Whether the method measures Prune&Comp's factors in its own loop (`MethodContext.measured_scales`), so that
        a compensation folds them without a walk of its own: its memory model then adds no compensation phase. False
        (the default) unless the method says so."""
        return False

    @classmethod
    def compute(cls, z: WorkspaceSizes, n: int, config: Any) -> ComputeModel | None:
        """The method's compute model for `optimum-flatten estimate` removing `n` layers: per timed phase, the stack
        passes it runs and the arithmetic its ops record (`compression.compute`). None (the default): only the total
        stack passes of `workspace` are known, and `estimate --device` predicts the total time alone.
        """
        return None

    def check_target(
        self, num_layers: int, num_to_remove: int, one_kind: Callable[[tuple[int, ...]], bool] | None = None
    ) -> None:
        """Refuses, before calibration (and before the model writes its own rows), a target this method's options
        cannot reach in a stack of `num_layers`: removals its blocks do not divide, more than its protected layers or
        its groups leave. `one_kind` is the adapter's layer-kind rule (`ArchitectureAdapter.layer_kind_rule`: sliding
        and full attention, NoPE layers never share a merged group), for the methods that merge. `estimate` asks it
        too. The default accepts; the plan still refuses what only the calibration can show."""
        return None

    def preflight(self, adapter: ArchitectureAdapter, stack: str) -> None:
        """Refuses, before calibration and before any weight changes, a model this method cannot compress.

        The default accepts: most methods say what they need through `required_capabilities` alone.
        """
        return None

    @abstractmethod
    def plan(self, adapter: ArchitectureAdapter, context: MethodContext, num_to_remove: int) -> LayerPlan:
        """Returns the plan removing `num_to_remove` layers of `context.stack`."""

    @abstractmethod
    def apply_(self, adapter: ArchitectureAdapter, plan: LayerPlan, context: MethodContext) -> None:
        """Changes the model so that its stack becomes `plan` (before renumbering and config update)."""


class LinearReplacementMethod(CompressionMethod):
    """A method whose result stands in for the blocks it removes with a linear map folded into what writes the
    residual stream before them (ReplaceMe, greedy_replace): the declarations that follow from that, in one place.

    It needs layer drops, it reads the MLP projections (the map goes into a down projection, or with ReplaceMe's
    'diagonal' estimator into a norm's gain), and it is a linear replacement already, so
    ``FlattenConfig(linear_replacement=...)`` on top would refit the same spans and is refused."""

    required_capabilities = frozenset({"layer_drop"})
    reads_mlp_projections = True
    accepts_linear_replacement = False


def _multi_stack_hint() -> str:
    """`` (NAME also takes OPTION)`` for every registered method that can change several stacks, else ``""``."""
    from ..registry import get_method_class, registered_methods

    hints = [
        f"{name} also takes {option}"
        for name in registered_methods()
        if (option := get_method_class(name).multi_stack_option)
    ]
    return f" ({'; '.join(hints)})" if hints else ""


def apply_layer_drop_(adapter: ArchitectureAdapter, plan: LayerPlan) -> None:
    """Applies a keep/drop plan (no merged groups): the shared final step of the layer-drop methods."""
    if plan.merged_groups:
        raise ValueError(f"a layer-drop method got a plan with merged groups {plan.merged_groups}.")
    adapter.keep_layers_(plan.stack, plan.first_indices)
