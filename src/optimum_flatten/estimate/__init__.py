"""Will it fit? The memory and compute a compression will need, from the model's shape alone (no weights, no text).

`estimate_checkpoint` reads a checkpoint's config.json, builds the model on the meta device (shapes, no storage) and
returns, for one method and one calibration size, the bytes every phase of the compression holds at its peak:

- **weights resident**: every parameter and buffer of the model once (tied tensors once), in the load dtype;
- **workspace**: everything the compression allocates on top of them, phase by phase, written as named terms
  (calibration states, statistics, factors, block copies, the largest per-batch temporaries);

and the cost in **stack passes**, the unit `FlattenQuantizer.report["cost"]` uses (weight x token products over one
pass of the calibration tokens through the original stack). The phases carry the names the methods time
(`report["timings_seconds"]`), so an estimate can be read against a run.

Every term follows what the code of the method holds alive (read from `methods/` and `calibration/`), and
`tests/test_estimate.py` checks the estimate, phase by phase, against the peak of the tensors a real compression
allocates on a small LLaMA. Symbols used below, all in bytes or element counts:

    N = nsamples · seqlen calibration tokens; T_b = batch_size · seqlen tokens in one calibration batch;
    d hidden size, i MLP width, H / KV query / key-value heads of size d_h, V vocabulary, L layers, n removed;
    b bytes of the model dtype; S = N·d·b one copy of the calibration states (the residual stream at one layer
    boundary, kept in the model dtype); S32 = N·d·4.

Terms every method shares:

- *runner*: `LayerwiseRunner` keeps the states entering layer 0 (S) and the call arguments of every batch
  (rotary cos/sin, 2·seqlen·d_h·b, and position ids, 8·seqlen, per batch, shared by the layers). The method context
  keeps every runner it created until the compression ends (`MethodContext._runners`, read for the cost), so a
  method that opens a second runner pays S twice.
- *run*: `LayerwiseRunner.run` collects the outputs of all batches in a list, so while it runs the last batch it
  holds (batches − 1)/batches · S of outputs besides its input.
- *block forward*: one decoder layer on one batch holds, at its largest, the gated MLP's act(gate), up and their
  product (3·T_b·i·b) beside the residual and the normed input (2·T_b·d·b); attention holds q, k, v and the rotary
  temporaries (T_b·d_h·b·(2·H + 5·KV) + T_b·d·b). Fused attention (SDPA) is assumed: no T_b·seqlen score matrix.
  A sparse MLP (a mixture of experts) holds every (token, routed expert) pair at once in transformers' default
  experts forward, far above its active width read as one dense MLP (`WorkspaceSizes.moe_forward`).

The per-method terms are documented on each method's `workspace` (FlattenGPT's in `methods/flattengpt/workspace.py`;
the shared terms and sizes in `compression/workspace.py`). Limits: a uniform stack (every layer the shape of
layer 0), packing (no padding), the whole model in one memory (with offloaded layers the weights resident drop to
what the device_map keeps, the workspace does not), and the LLaMA layout of a block (other families are estimated
with the same formulas; their per-batch temporaries may differ).

Not counted: the tokenised calibration text. `calibration.tokens.token_stream` holds every token of the corpus at 8
bytes (int64) beside the model while the batches are drawn, and frees it before the first phase (2.26M tokens of the
bundled speeches: 17 MiB, with the tokenizer's own per-chunk encodings about 50 MiB at the peak). The estimate reads
no text, so it does not know the corpus's size; on a corpus of G tokens add 8·G bytes to the weights before the
calibration starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..adapters import get_adapter
from ..adapters.base import ArchitectureAdapter
from ..adapters.moe import MoeShape, moe_shape, unrouted_weights
from ..compression.compute import ComputeModel
from ..compression.correction_workspace import with_correction, with_correction_compute
from ..compression.method import CompressionMethod
from ..compression.pipeline import Corrections, preflight
from ..compression.workspace import Phase, Refusal, WorkspaceSizes
from ..options import CalibrationConfig
from ..registry import get_method_class, registered_methods, require_capabilities
from ..roofline import DeviceSpec, TimePrediction, predict
from ..utils import flops
from ..utils.errors import UnsupportedArchitectureError
from ..utils.positions import check_sequence_length
from .meta import compressed_shape_ as compressed_shape_  # the healed shape, for callers reading an estimate
from .meta import meta_model, single_stack

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes an estimate needs, read from a model (on the meta device or not).

    Attributes:
        layer_weights, attention_weights, mlp_weights, head_weights: parameter counts of one layer, of its
            attention (q, k, v, o), of its MLP, and of the LM head (0 without one).
        o_weights, down_weights: parameters of one layer's output and down projections (a run that stops at their
            input skips them).
        weights_bytes: every parameter and buffer of the model once, at its own dtype.
        dtype_bytes: bytes of one element of the model's floating-point weights (and of its states).
        active_weights: parameters of the whole stack that one token is multiplied by, layer by layer (a mixture's
            routed experts only, `adapters.moe.unrouted_weights`): the flops of a forward, `dense_forward_flops`.
        moe: the routing of the stack's first sparse MLP (`adapters.moe.MoeShape`), None in a dense stack: its
            temporaries on a batch (`WorkspaceSizes.block_forward`).
        dense_mlp_width: with `moe`, the widest dense MLP among the sparse ones (``mlp_only_layers``), 0 for none.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool
    dtype: str
    dtype_bytes: int
    weights_bytes: int
    layer_weights: int
    attention_weights: int
    mlp_weights: int
    head_weights: int
    o_weights: int = 0
    down_weights: int = 0
    active_weights: int = 0
    moe: MoeShape | None = None
    dense_mlp_width: int = 0

    @property
    def norm_weights(self) -> int:
        """Parameters of one layer outside attention and MLP (its norms): a wide block keeps one set."""
        return self.layer_weights - self.attention_weights - self.mlp_weights

    @property
    def layer_bytes(self) -> int:
        return self.layer_weights * self.dtype_bytes

    @classmethod
    def of(cls, model: nn.Module, stack: str | None = None) -> ModelShape:
        """Reads the shape of `model` through its architecture adapter (so every supported family works)."""
        adapter = get_adapter(model)
        stack = stack or single_stack(adapter)
        block = adapter.block(stack, 0)
        attention, mlp = block.attention, block.mlp
        if "dense_mlp" in adapter.capabilities:
            mlp_weights = sum(_count_view(v) for v in (mlp.up, mlp.gate, mlp.down) if v is not None)
            gated, down_weights = mlp.gate is not None, _count_view(mlp.down)
        else:  # a mixture: the router, every expert and the shared expert, held whether a token is routed or not
            mlp_weights, gated = _count(mlp.module), True
            down_weights = sum(p.numel() for p in adapter.mlp_writers(block.module, 0))
        head = adapter.lm_head(stack)
        layers = adapter.layers(stack)
        floating = [p for p in model.parameters() if p.is_floating_point()]
        return cls(
            architecture=type(model).__name__,
            num_layers=adapter.num_layers(stack),
            hidden_size=attention.geometry.hidden_size,
            intermediate_size=adapter.mlp_active_width(block.module, 0),
            num_heads=attention.geometry.num_heads,
            num_kv_heads=attention.geometry.num_kv_heads,
            head_dim=attention.geometry.head_dim,
            vocab_size=0 if head is None else int(next(head.parameters()).shape[0]),
            gated_mlp=gated,
            dtype=str(floating[0].dtype).removeprefix("torch.") if floating else "float32",
            dtype_bytes=floating[0].element_size() if floating else 4,
            weights_bytes=_unique_bytes(model),
            layer_weights=_count(block.module),
            attention_weights=sum(_count_view(v) for v in (attention.q, attention.k, attention.v, attention.o)),
            mlp_weights=mlp_weights,
            head_weights=0 if head is None else _count(head),
            o_weights=_count_view(attention.o),
            down_weights=down_weights,
            active_weights=_count(layers) - sum(unrouted_weights(layer) for layer in layers),
            **_sparse_mlps(adapter, layers),
        )

    def to_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()}


@dataclass(frozen=True)
class CalibrationShape:
    """The calibration size: `nsamples` sequences of `seqlen` tokens, run `batch_size` sequences at a time."""

    nsamples: int
    seqlen: int
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    @property
    def tokens(self) -> int:
        return self.nsamples * self.seqlen

    @property
    def batches(self) -> int:
        return math.ceil(self.nsamples / self.batch_size)

    @property
    def batch_tokens(self) -> int:
        return min(self.batch_size, self.nsamples) * self.seqlen


@dataclass
class MemoryEstimate:
    """What a compression will hold and cost. `peak_bytes` = weights + the largest phase's workspace."""

    method: str
    num_layers_to_remove: int
    model: ModelShape
    calibration: CalibrationShape
    phases: list[Phase]
    stack_passes: float
    stack_passes_is_bound: bool = False
    notes: list[str] = field(default_factory=list)
    source: str | None = None
    #: The compute model (stack passes and arithmetic per phase), when the method states one (`compute_estimate`).
    compute: ComputeModel | None = None
    #: One forward of the original stack over the calibration tokens, the arithmetic's unit.
    dense_forward_flops: float = 0.0
    #: Predicted seconds on a device (`with_device`).
    prediction: TimePrediction | None = None
    #: With ``heal=``: the mode the run will choose, the memory line behind it and its footprint (`estimate.healing`).
    heal: dict[str, Any] | None = None
    #: With ``heal=``: what ``mode='full'`` healing adds beside the teacher copy (`recovery.footprint`), in bytes.
    heal_full: dict[str, int] | None = None
    #: With ``heal=``: what each fallback of the default mode adds, and the teacher text's sampling batch, in bytes.
    heal_fallbacks: dict[str, Any] | None = None

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def workspace_bytes(self) -> int:
        return self.peak_phase.bytes

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.workspace_bytes

    def phase(self, name: str) -> Phase:
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"no phase {name!r}; phases: {[p.name for p in self.phases]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "method": self.method,
            "num_layers_to_remove": self.num_layers_to_remove,
            "model": self.model.to_dict(),
            "calibration": {
                "nsamples": self.calibration.nsamples,
                "seqlen": self.calibration.seqlen,
                "batch_size": self.calibration.batch_size,
                "tokens": self.calibration.tokens,
            },
            "weights_bytes": self.weights_bytes,
            "workspace_bytes": {
                "peak": self.workspace_bytes,
                "peak_phase": self.peak_phase.name,
                "phases": {p.name: p.bytes for p in self.phases},
            },
            "peak_bytes": self.peak_bytes,
            "stack_passes": self.stack_passes,
            "stack_passes_is_bound": self.stack_passes_is_bound,
            "phases": [p.to_dict() for p in self.phases],
            "notes": list(self.notes),
            **({"heal": self.heal} if self.heal is not None else {}),
            **({"heal_full_bytes": self.heal_full} if self.heal_full is not None else {}),
            **({"heal_fallbacks": self.heal_fallbacks} if self.heal_fallbacks is not None else {}),
            **self._compute_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        """A table of the phases, the peak with its largest terms, and the stack passes (what the CLI prints)."""
        shape, cal = self.model, self.calibration
        lines = [
            f"{self.method}: {shape.architecture}, {shape.num_layers} layers (hidden {shape.hidden_size}, MLP "
            f"{shape.intermediate_size}, {shape.num_heads} heads / {shape.num_kv_heads} KV), "
            f"{shape.dtype}; removing {self.num_layers_to_remove} layers; calibration "
            f"{cal.nsamples} x {cal.seqlen} tokens in batches of {cal.batch_size}",
            "",
        ]
        rows = [(p.name, _gib(p.bytes), _gib(p.bytes + self.weights_bytes)) for p in self.phases]
        header = ("phase", "workspace", "with weights")
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(3)]
        for k, row in enumerate([header, *rows]):
            cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))]
            lines.append("  ".join(cells))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        peak = self.peak_phase
        largest = sorted(peak.terms, key=lambda t: -t.bytes)[:4]
        lines += [
            "",
            f"weights resident: {_gib(self.weights_bytes)}",
            f"peak workspace:   {_gib(self.workspace_bytes)} in {peak.name} (largest: "
            + "; ".join(f"{t.name} {_gib(t.bytes)}" for t in largest)
            + ")",
            f"peak:             {_gib(self.peak_bytes)} ({self.peak_bytes:,} bytes)",
            f"stack passes:     {'at most ' if self.stack_passes_is_bound else ''}{self.stack_passes:.3f} (one pass: "
            f"{cal.tokens:,} tokens through the {shape.num_layers}-layer stack)",
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines + self._describe_compute())

    # ------------------------------------------------------------------------------------------- compute and time
    def with_device(self, device: DeviceSpec) -> MemoryEstimate:
        """The same estimate with predicted seconds on `device` (`roofline.predict`)."""
        compute = self.compute
        stack_weights = self.model.layer_weights * self.model.num_layers
        prediction = predict(
            device,
            self.dense_forward_flops,
            _precision(self.model.dtype),
            stack_weights * self.model.dtype_bytes,
            self.calibration.batches,
            None if compute is None else compute.phase_passes,
            None if compute is None else compute.arithmetic,
            self.stack_passes,
        )
        return dataclasses.replace(self, prediction=prediction)

    def _compute_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {"dense_forward_flops": self.dense_forward_flops}
        if self.compute is not None:
            result["compute"] = self.compute.to_dict()
            result["compute"]["arithmetic_dense_forwards"] = {
                name: round(arithmetic_flops(kinds) / self.dense_forward_flops, 4)
                for name, kinds in self.compute.arithmetic.items()
            }
        if self.prediction is not None:
            result["prediction"] = self.prediction.to_dict()
        return result

    def _describe_compute(self) -> list[str]:
        """The arithmetic per phase in dense forwards and, with a device, the predicted seconds per phase."""
        lines: list[str] = []
        unit = self.dense_forward_flops
        if self.compute is not None and unit:
            lines += ["", f"compute per phase (one dense forward of the stack: {unit:.3g} FLOPs)"]
            rows = [
                ("phase", "stack passes", "arithmetic (dense forwards)", *(("predicted s",) if self.prediction else ()))
            ]
            names = dict.fromkeys([*self.compute.phase_passes, *self.compute.arithmetic])
            for name in names:
                row = (
                    name,
                    f"{self.compute.phase_passes.get(name, 0.0):.3f}",
                    f"{arithmetic_flops(self.compute.arithmetic.get(name, {})) / unit:.3f}",
                )
                if self.prediction is not None:
                    row += (f"{self.prediction.phases.get(name, {}).get('seconds', 0.0):.1f}",)
                rows.append(row)
            widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
            for k, row in enumerate(rows):
                lines.append(
                    "  ".join(
                        c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
                    )
                )
                if k == 0:
                    lines.append("  ".join("-" * w for w in widths))
            lines += [f"note: {note}" for note in self.compute.notes]
        if self.prediction is not None:
            p = self.prediction
            lines += [
                "",
                f"predicted on {p.device.name}: {p.total_seconds:.1f} s in all; one dense forward of the stack "
                f"{p.forward_seconds:.2f} s ({p.total_seconds / p.forward_seconds:.2f} dense forwards)",
            ]
            lines += [f"note: {note}" for note in p.notes]
        return lines


def _sparse_mlps(adapter: ArchitectureAdapter, layers: nn.ModuleList) -> dict[str, Any]:
    """``moe`` (the first sparse MLP's routing) and ``dense_mlp_width`` (the widest dense MLP among the sparse ones)
    of a stack with sparse MLPs; nothing for a dense stack, whose layer 0 stands for every layer."""
    shapes = [next(filter(None, map(moe_shape, layer.modules())), None) for layer in layers]
    sparse = [shape for shape in shapes if shape is not None]
    if not sparse:
        return {}
    dense = [
        adapter.mlp_active_width(layer, k)
        for k, (layer, shape) in enumerate(zip(layers, shapes, strict=True))
        if not shape
    ]
    return {"moe": sparse[0], "dense_mlp_width": max(dense, default=0)}


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _count_view(view: Any) -> int:
    return view.weight.numel() + (0 if view.bias is None else view.bias.numel())


def _unique_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


# ------------------------------------------------------------------------------------------------------ entry points
def modelled_methods() -> list[str]:
    """The registered methods that state a memory model (`CompressionMethod.workspace`), sorted."""
    base = CompressionMethod.workspace.__func__
    return [name for name in registered_methods() if get_method_class(name).workspace.__func__ is not base]


def estimate_memory(
    model: nn.Module,
    method: str,
    num_layers_to_remove: int,
    nsamples: int = 128,
    seqlen: int = 2048,
    batch_size: int = 8,
    method_args: dict[str, Any] | None = None,
    stack: str | None = None,
    corrections: Corrections | None = None,
) -> MemoryEstimate:
    """The estimate for compressing `model` (real or on the meta device: only shapes are read), with `corrections`
    (a linear replacement or a compensation at every cut; `compression.correction_workspace`) when given.

    Raises:
        ValueError: a method that is not modelled, a target that removes no layer or every layer, or a model the
            method refuses (the same refusals as `FlattenQuantizer.compress`, before any work).
    """
    if method not in modelled_methods():
        raise ValueError(f"no memory model for method {method!r}; the estimate covers {modelled_methods()}.")
    corrections = corrections or Corrections()
    method_class = get_method_class(method)
    config = method_class.config_class(**(method_args or {}))
    from ..config import check_corrections  # FlattenConfig's own refusals of a correction

    check_corrections(corrections.linear_replacement, corrections.compensation, method, method_class)
    adapter = get_adapter(model)
    if stack is not None and stack not in adapter.stacks():
        raise ValueError(f"this {type(model).__name__} has the stacks {adapter.stacks()}, not {stack!r}.")
    require_capabilities(adapter, method, stack)
    stack = stack or single_stack(adapter)
    preflight(adapter, method_class(config), stack, corrections, weights=False)  # built on meta, never run
    shape = ModelShape.of(model, stack)
    if (
        not isinstance(num_layers_to_remove, int)
        or isinstance(num_layers_to_remove, bool)
        or not 0 < num_layers_to_remove < shape.num_layers
    ):
        raise ValueError(
            f"num_layers_to_remove must be between 1 and {shape.num_layers - 1} for a stack of {shape.num_layers} "
            f"layers, got {num_layers_to_remove!r}."
        )
    # compress refuses it there too
    method_class(config).check_target(shape.num_layers, num_layers_to_remove, adapter.layer_kind_rule(stack))
    images = adapter.calibrates_on == "images"
    if images:  # a row is an image: CLS + patches at the config's size, whatever `seqlen` says
        seqlen = adapter.image_positions()
    else:
        check_sequence_length(model, seqlen)  # a position table shorter than the rows: compress refuses it too
    calibration = CalibrationShape(nsamples, seqlen, batch_size)
    sizes = WorkspaceSizes(shape, calibration, refusal_of(adapter, stack))
    if method_class.measures_compensation(config):  # the factors come from the method's loop: no walk of their own
        corrections = dataclasses.replace(corrections, compensation=None)
    phases, passes, bound, notes = method_class.workspace(sizes, num_layers_to_remove, config)
    phases, passes, more = with_correction(
        sizes, num_layers_to_remove, corrections, phases, passes, method_class.keeps_runner_states(config)
    )
    bound = bound or bool(more)
    notes = [*notes, *more, *([f"calibration rows are images: {seqlen} positions each (CLS + patches)"] * images)]
    computed = compute_estimate(method_class, sizes, num_layers_to_remove, config)
    computed["compute"] = with_correction_compute(sizes, num_layers_to_remove, corrections, computed["compute"])
    return MemoryEstimate(
        method=method,
        num_layers_to_remove=num_layers_to_remove,
        model=shape,
        calibration=calibration,
        phases=phases,
        stack_passes=round(passes, 3),
        stack_passes_is_bound=bound,
        notes=notes,
        **computed,
    )


def refusal_of(adapter: ArchitectureAdapter, stack: str) -> Refusal:
    """The model's answer to a (method, config, corrections) request (`compression.workspace.Refusal`): the refusals
    a compression runs before any work (`require_capabilities`, `preflight`)."""

    def refusal(name: str, config: Any, corrections: Corrections) -> str | None:
        try:
            require_capabilities(adapter, name)
            preflight(adapter, get_method_class(name)(config), stack, corrections, weights=False)
        except UnsupportedArchitectureError:
            return "architecture"
        except ValueError:
            return "request"
        return None

    return refusal


def estimate_checkpoint(
    source: str,
    method: str,
    num_layers_to_remove: int,
    nsamples: int = 128,
    seqlen: int = 2048,
    batch_size: int = 8,
    dtype: str = "float32",
    method_args: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    device: DeviceSpec | None = None,
    heal: bool = False,
    corrections: Corrections | None = None,
    stack: str | None = None,
    free_memory: int | None = None,
    heal_seqlen: int | None = None,
    own_text: float = 0.0,
) -> MemoryEstimate:
    """The estimate for a checkpoint folder, a Hub id (its config.json only) or a bundled name, without weights;
    with `device`, the predicted seconds on it too; with `heal`, ``FlattenConfig(heal=...)``'s: the teacher copy in
    every phase and the healing's own phase, in the mode the run will choose (`estimate.healing`) on a device with
    `free_memory` bytes free before the model is loaded (read on this machine when None), with healing rows of
    `heal_seqlen` tokens (the healing's default when None); with `own_text`, the model's sampling of that share of
    the calibration rows first, its batch sized within the same free memory (`estimate.own_text`)."""
    calibration = CalibrationConfig(nsamples=nsamples, seqlen=seqlen, batch_size=batch_size, own_text=own_text)
    model = meta_model(source, dtype, trust_remote_code)
    if own_text:
        from ..recovery.own_calibration import check_writes_text  # compress's own refusal

        check_writes_text(model, own_text)
    if heal:  # the refusals `compress --heal-tokens` gives before it loads anything
        from ..recovery import RecoveryConfig
        from ..utils.causal_lm import check_causal_lm

        check_causal_lm(model)
        healing = RecoveryConfig() if heal_seqlen is None else RecoveryConfig(seqlen=heal_seqlen)
        check_sequence_length(model, healing.seqlen, "the heal's seqlen", warn=False)
    result = estimate_memory(
        model, method, num_layers_to_remove, nsamples, seqlen, batch_size, method_args, stack, corrections
    )
    result.source = source
    method_class = get_method_class(method)
    samples = own_text > 0 and method_class(method_class.config_class(**(method_args or {}))).requires_calibration
    if heal:
        from .healing import heal_budget, with_healing  # the recovery package, only for a heal

        budget = heal_budget(model, free_memory, device)
        result = with_healing(result, model, healing, budget, method_class.merges_layers)
    if samples:
        from .own_text import sampling_budget, with_own_text  # after the heal's copy: the rows are sampled before it

        result = with_own_text(result, model, calibration, sampling_budget(model, free_memory, device))
    return result if device is None else result.with_device(device)


def compute_estimate(method_class: type[CompressionMethod], z: WorkspaceSizes, n: int, config: Any) -> dict[str, Any]:
    """The compute fields of an estimate: the method's compute model (None when it states none) and the dense
    forward's flops over the calibration tokens (`utils.flops.dense_forward_flops`), its unit."""
    s, cal = z.shape, z.cal
    weights = s.active_weights or s.layer_weights * s.num_layers  # a token's weights: its routed experts only
    dense = flops.dense_forward_flops(weights, cal.tokens, cal.seqlen, s.num_layers, s.num_heads * s.head_dim)
    return {"compute": method_class.compute(z, n, config), "dense_forward_flops": dense}


def arithmetic_flops(kinds: dict[str, dict[str, float]]) -> float:
    """Flops of one phase's arithmetic (host reads and launches are counted apart)."""
    return sum(v for kind, values in kinds.items() if kind not in flops.EVENT_KINDS for v in values.values())


def _precision(dtype: str) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}.get(dtype, dtype)
