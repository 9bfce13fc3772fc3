"""What a compression did and measured: the typed record `FlattenQuantizer.compress` returns in `quantizer.report`.

The core fields are the compressor's own measurements (plan, parameters, calibration, cost, timings); the method's
entries (SLEB's steps, FlattenGPT's groups, ...) sit beside them in `method_entries`. Readers written against the
saved flatten_report.json (the model card, the CLI, the benchmarks, users' scripts) index it as one flat mapping,
so the report is also a read-only `Mapping` whose keys are exactly those of that file: typed fields for the code,
the same flat view for everything that reads the JSON.

Why the method's entries are not nested under the method's name in the file: flatten_report.json is read by users'
scripts and by `retie_ffn_` on saved checkpoints, which index it flat (``report["ffn_groups"]``), and nesting would
break every one of them for no gain in safety. What nesting would protect, that a method's key overwrites a core
field such as ``plan``, is refused when the record is built (`__post_init__`), and the typed record keeps the two
apart (`method_entries`), so code can tell which entries are the method's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class CompressionReport(Mapping[str, Any]):
    """One compression's record.

    Attributes:
        method: The registered method name (``FlattenConfig.method``).
        method_args: The method's options as given.
        model_type: ``config.model_type`` of the compressed model.
        base_model: The public name of the checkpoint the model was loaded from ("" when unknown or local).
        base_model_on_hub: Whether `base_model` names a Hub repository (the card links it only then).
        license: The base checkpoint's licence, when its card or config states one.
        architecture: The model's class name.
        plan: `LayerPlan.to_dict()` of the planned stack.
        plan_summary: `LayerPlan.describe()`, one line.
        num_layers_before: Layers of the planned stack before.
        num_layers_after: Layers of the planned stack after.
        parameters_before: Parameters of the model before.
        parameters_after: Parameters of the model after, as it is in memory.
        calibration: Dataset description, nsamples, seqlen, seed, packing and the real calibration tokens.
        timings_seconds: Wall seconds per phase (synchronised on accelerators).
        cost: Stack passes (`compute_cost`) and their unit.
        total_seconds: Wall seconds of the whole `compress` call.
        source_fingerprint: `utils.fingerprint.weights_fingerprint` of the dense model (config fields and a sample
            of every weight, never its path): `recover` warns when a teacher does not match it.
        method_entries: The method's own entries (``MethodContext.report``); none may reuse a core field's name,
            which a method could otherwise overwrite (a defect of that method, refused here).
    """

    method: str
    method_args: dict[str, Any]
    model_type: str
    base_model: str
    base_model_on_hub: bool
    license: str | None
    architecture: str
    plan: dict[str, Any]
    plan_summary: str
    num_layers_before: int
    num_layers_after: int
    parameters_before: int
    parameters_after: int
    calibration: dict[str, Any]
    timings_seconds: dict[str, float]
    cost: dict[str, Any]
    total_seconds: float
    source_fingerprint: str = ""
    method_entries: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clashes = sorted(set(core_fields()) & set(self.method_entries))
        if clashes:
            raise RuntimeError(
                f"method {self.method!r} reported {clashes}, which the core report owns; a method reports under "
                f"keys of its own (e.g. report[{self.method!r}]), so that it cannot overwrite what the compressor "
                "measured."
            )

    def to_dict(self) -> dict[str, Any]:
        """The flat dictionary flatten_report.json holds: the core fields, then the method's entries."""
        core = {name: getattr(self, name) for name in core_fields()}
        return {**core, **self.method_entries}

    # A read-only flat view, so that code reading the saved JSON reads the in-memory report the same way.
    def __getitem__(self, key: str) -> Any:
        if key in core_fields():
            return getattr(self, key)
        return self.method_entries[key]

    def __iter__(self) -> Iterator[str]:
        yield from core_fields()
        yield from self.method_entries

    def __len__(self) -> int:
        return len(core_fields()) + len(self.method_entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable contents: like a dict, not hashable


def core_fields() -> tuple[str, ...]:
    """The names of the compressor's own fields, in the order the saved report lists them."""
    return _CORE_FIELDS


_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(CompressionReport) if f.name != "method_entries")


def check_describes(model: Any, report: Mapping[str, Any]) -> dict[str, Any]:
    """`report` as a dict, once it is known to describe `model`: a save writes it beside the weights as
    flatten_report.json and the model card, so a report of another model (a quantizer that compressed one model and
    is asked to save another) or none at all (a model never compressed) would publish a false plan and card.

    Raises:
        ValueError: an empty report, or one whose parameter count after the compression is not `model`'s.
    """
    from .utils.torch_utils import count_parameters

    if not report:
        raise ValueError(
            "this model carries no compression report and the quantizer compressed none: compress it first "
            "(FlattenQuantizer(config).compress(model, tokenizer)), or save an uncompressed model with save_pretrained."
        )
    expected, found = report.get("parameters_after"), count_parameters(model)
    if isinstance(expected, int) and expected != found:
        raise ValueError(
            f"this model has {found:,} parameters, and the compression this report describes left {expected:,}: it "
            "is not the model this quantizer compressed; save that one, or compress this one with its own quantizer."
        )
    return dict(report)
