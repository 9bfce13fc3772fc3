"""What to do: the user-facing configuration and the canonical layer plan.

`FlattenConfig` is a transformers quantization config (``quant_method="flatten"``) so that it can travel through
``from_pretrained(..., quantization_config=...)``; it carries the method name, the depth target, the calibration
options and the method's own arguments. `LayerPlan` is the one canonical form of a depth change that every method
produces and every adapter applies.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from .options.calibration import CalibrationConfig
from .options.corrections import COMPENSATIONS, ESTIMATORS
from .options.hints import MethodConfig, check_option_types, option_converter, parse_method_options
from .options.recovery import parse_heal
from .options.request import RequestOptions
from .plan import LayerGroup, LayerPlan
from .utils.errors import InvalidTargetError, did_you_mean, reject_unknown_keys
from .utils.loading import describe_dataset

logger = logging.getLogger(__name__)

CONFIG_VERSION = 1


_CALIBRATION_FIELDS = tuple(f.name for f in dataclasses.fields(CalibrationConfig))


class FlattenConfig(QuantizationConfigMixin):
    """The whole request: which method, how many layers, which calibration data, and the method's options.

    Calibration options (`dataset`, `nsamples`, `seqlen`, `seed`, `batch_size`, `packing`, `text_column`) and the
    method's own options (e.g. FlattenGPT's `calibration_mode` or `max_group_size`) may be passed flat; method
    options are validated against the method's config class, and unknown keys raise with a did-you-mean hint.

    Args:
        method: Registry key of the compression method (``"flattengpt"``, ``"shortgpt"``, ...).
        num_layers_to_remove: How many layers the stack loses. Exactly one of this and `target_sparsity`, except
            for a depth-keeping method (``ffn_merge``), which takes neither and is steered by its own options.
        target_sparsity: Fraction of layers to remove, rounded to the nearest whole layer.
        method_args: The method's options as a dict (merged with any flat method options).
        stacks: Which block stacks to compress (``["decoder"]`` for decoder-only LMs; one name alone is one stack).
        layer_plan: Filled in after compression with the applied plan (provenance); not an input.
        tokenizer: Only for compress-on-load; never serialised.
        version: Config format version; a mismatch warns.
        linear_replacement, compensation: A correction folded at every cut (docs/methods/replaceme.md,
            docs/methods/compensation.md).
        heal: After compressing, heal the model by distillation from the dense one (`recovery.recover`): a
            training-token budget, or a mapping of `RecoveryConfig` fields plus ``dataset`` (default: the
            calibration text). The dense weights are the teacher, so a copy of them is held while compressing and
            healing (one more model's worth of memory). None (the default) heals nothing.
        resume_dir: A folder where the compression keeps its per-layer state, so that a run killed mid-way and
            started again with the same folder resumes there (`compression.resume`, docs/workflows.md). A local
            path of this machine: like `tokenizer`, never serialised.
        **kwargs: Calibration options and method options, flat.
    """

    def __init__(
        self,
        method: str = "flattengpt",
        num_layers_to_remove: int | None = None,
        target_sparsity: float | None = None,
        method_args: Mapping[str, Any] | None = None,
        stacks: Sequence[str] | None = None,
        layer_plan: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        version: int = CONFIG_VERSION,
        quant_method: str = "flatten",
        linear_replacement: str | None = None,
        compensation: str | None = None,
        heal: int | Mapping[str, Any] | None = None,
        resume_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        from .registry import get_method_class

        self.quant_method = "flatten"
        if quant_method != "flatten":
            raise ValueError(f"FlattenConfig has quant_method 'flatten', got {quant_method!r}.")
        method_class = get_method_class(method)
        self.method = method
        self.num_layers_to_remove = num_layers_to_remove
        self.target_sparsity = target_sparsity
        _check_shapes(stacks=stacks, method_args=method_args, layer_plan=layer_plan, version=version, **kwargs)
        # One name is one stack ("decoder"), not its letters.
        self.stacks = ([stacks] if isinstance(stacks, str) else list(stacks)) if stacks is not None else None
        self.layer_plan = dict(layer_plan) if layer_plan is not None else None
        self.version = int(version)
        if self.version != CONFIG_VERSION:
            warnings.warn(
                f"FlattenConfig version {self.version} differs from this library's {CONFIG_VERSION}; "
                "fields may be interpreted differently.",
                stacklevel=2,
            )
        self._tokenizer = tokenizer
        check_corrections(linear_replacement, compensation, method, method_class)
        self.linear_replacement = linear_replacement
        self.compensation = compensation
        self.heal = parse_heal(heal)
        if resume_dir is not None and not isinstance(resume_dir, (str, os.PathLike)):
            raise TypeError(f"resume_dir must be a folder path, got {type(resume_dir).__name__}.")
        self.resume_dir = None if resume_dir is None else os.fspath(resume_dir)

        calibration_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _CALIBRATION_FIELDS}
        calibration = kwargs.pop("calibration", None)
        if isinstance(calibration, CalibrationConfig):
            calibration = dataclasses.asdict(calibration)
        if calibration:
            reject_unknown_keys(calibration, _CALIBRATION_FIELDS, "calibration")
            _refuse_two_values(calibration, calibration_kwargs, "calibration")
            calibration_kwargs = {**calibration, **calibration_kwargs}
        self.calibration = CalibrationConfig(**calibration_kwargs)

        method_fields = {f.name for f in dataclasses.fields(method_class.config_class)}
        merged_args = dict(method_args or {})
        flat_args = {key: kwargs.pop(key) for key in list(kwargs) if key in method_fields}
        _refuse_two_values(merged_args, flat_args, "method_args")
        merged_args.update(flat_args)
        if kwargs:
            allowed = set(_CALIBRATION_FIELDS) | method_fields | set(_TOP_LEVEL_FIELDS)
            unknown = sorted(kwargs)
            raise TypeError(
                f"FlattenConfig got unknown option(s) {unknown}.{did_you_mean(unknown[0], allowed)} "
                f"Allowed: {sorted(allowed)}."
            )
        self.method_config = method_class.config_class.from_dict(merged_args)
        self._validate_target(keeps_depth=method_class.keeps_depth)

    # ------------------------------------------------------------------ target
    def _validate_target(self, keeps_depth: bool = False) -> None:
        if keeps_depth:
            # A depth-keeping method (e.g. ffn_merge shares parameters between layers) states its target through its
            # own options; a layer count would be silently meaningless, so it is refused.
            if self.num_layers_to_remove is not None or self.target_sparsity is not None:
                raise InvalidTargetError(
                    f"method {self.method!r} keeps every layer, so num_layers_to_remove and target_sparsity do not "
                    f"apply, got num_layers_to_remove={self.num_layers_to_remove!r}, "
                    f"target_sparsity={self.target_sparsity!r}; drop them and set the method's own options "
                    "(see docs/methods)."
                )
            return
        if (self.num_layers_to_remove is None) == (self.target_sparsity is None):
            raise InvalidTargetError(
                "give exactly one of num_layers_to_remove and target_sparsity, got "
                f"num_layers_to_remove={self.num_layers_to_remove!r}, target_sparsity={self.target_sparsity!r}; "
                "e.g. FlattenConfig(num_layers_to_remove=6) or FlattenConfig(target_sparsity=0.2)."
            )
        if self.num_layers_to_remove is not None:
            n = self.num_layers_to_remove
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InvalidTargetError(f"num_layers_to_remove must be an integer >= 1, got {n!r}.")
        if self.target_sparsity is not None:
            s = self.target_sparsity
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0.0 < float(s) < 1.0:
                raise InvalidTargetError(f"target_sparsity must be a fraction strictly between 0 and 1, got {s!r}.")

    def resolve_num_layers_to_remove(self, num_layers: int) -> int:
        """The number of layers to remove from a stack of `num_layers`, checked against what is possible.

        Raises:
            InvalidTargetError: if the target would remove no layer or every layer.
        """
        if self.num_layers_to_remove is not None:
            n = self.num_layers_to_remove
            source = f"num_layers_to_remove={n}"
        else:
            n = round(float(self.target_sparsity) * num_layers)
            source = f"target_sparsity={self.target_sparsity} of {num_layers} layers"
        if not 1 <= n < num_layers:
            raise InvalidTargetError(
                f"cannot remove {n} layer(s) ({source}) from a stack of {num_layers}: at least 1 and at most "
                f"{num_layers - 1} can be removed. Choose a {'larger' if n < 1 else 'smaller'} target."
            )
        return n

    # ---------------------------------------------------------- serialisation
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def method_args(self) -> dict[str, Any]:
        return self.method_config.to_dict()

    def to_dict(self) -> dict[str, Any]:
        calibration = dataclasses.asdict(self.calibration)
        calibration["dataset"] = describe_dataset(self.calibration.dataset)
        return {
            "quant_method": self.quant_method,
            "method": self.method,
            "num_layers_to_remove": self.num_layers_to_remove,
            "target_sparsity": self.target_sparsity,
            "method_args": self.method_args,
            "calibration": calibration,
            "stacks": copy.deepcopy(self.stacks),
            "layer_plan": copy.deepcopy(self.layer_plan),
            "linear_replacement": self.linear_replacement,
            "compensation": self.compensation,
            "heal": _describe_heal(self.heal),
            "version": self.version,
        }

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """Rebuilds a config from `to_dict` output; unknown keys raise (with a did-you-mean hint). A keyword replaces
        what the dict says, a calibration option's too: ``from_dict(saved, dataset=texts)`` gives back the texts
        `to_dict` only described."""
        data = {**config_dict, **kwargs}
        if isinstance(config_dict.get("calibration"), Mapping):
            data["calibration"] = {k: v for k, v in config_dict["calibration"].items() if k not in kwargs}
        config = cls(**data)
        return (config, {}) if return_unused_kwargs else config

    def __eq__(self, other: object) -> bool:
        # to_dict describes texts given in memory by their count alone: two configs on other texts are not equal.
        return (
            isinstance(other, FlattenConfig)
            and self.to_dict() == other.to_dict()
            and _same_data(self.calibration.dataset, other.calibration.dataset)
            and _same_data((self.heal or {}).get("dataset"), (other.heal or {}).get("dataset"))
        )

    def __repr__(self) -> str:
        return f"FlattenConfig({self.to_dict()})"


#: Every keyword `FlattenConfig` takes besides the calibration's and the method's: the request's own options
#: (declared once in `options.request.RequestOptions`, which the command line reads too) and the config's plumbing.
_TOP_LEVEL_FIELDS = (
    *(f.name for f in dataclasses.fields(RequestOptions)),
    "heal",
    "method_args",
    "layer_plan",
    "tokenizer",
    "version",
    "quant_method",
    "calibration",
)


def _check_shapes(
    stacks: Any, method_args: Any, layer_plan: Any, version: Any, calibration: Any = None, **_: Any
) -> None:
    """Refuses, in one line naming the option, a value of the wrong shape where Python's own error would name none
    (``stacks=5``: "'int' object is not iterable"; ``method_args="x"``: "dictionary update sequence ...")."""
    shapes = {"method_args": "option names to values", "calibration": "option names to values"}
    shapes["layer_plan"] = "a LayerPlan's fields (LayerPlan.to_dict())"
    for name, value in (("method_args", method_args), ("layer_plan", layer_plan), ("calibration", calibration)):
        if value is not None and not isinstance(value, (Mapping, CalibrationConfig)):
            raise TypeError(f"{name} must be a mapping of {shapes[name]}, got {value!r}.")
    names = [stacks] if isinstance(stacks, str) else stacks
    if stacks is not None and (
        not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names)
    ):
        raise TypeError(f"stacks must be a stack name or a non-empty list of them (e.g. ['decoder']), got {stacks!r}.")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an integer, got {version!r}.")


def _same_data(a: Any, b: Any) -> bool:
    """Whether two datasets are the same: texts in memory by value, a name or path by itself (in `to_dict` already),
    any other object (a `datasets.Dataset`) by identity."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a is b or (isinstance(a, (str, int, float, type(None))) and isinstance(b, (str, int, float, type(None))))


def _describe_heal(heal: dict[str, Any] | None) -> dict[str, Any] | None:
    """The heal settings as JSON (a dataset object is described, never serialised), less the folders it keeps its
    state in: local paths, which a saved config would publish (as ``resume_dir`` is left out)."""
    if heal is None:
        return heal
    described = {k: v for k, v in heal.items() if k not in LOCAL_HEAL_FOLDERS}
    if "dataset" in heal:
        described["dataset"] = describe_dataset(heal["dataset"])
    return described


#: The heal settings that name a folder of this machine (`_describe_heal` leaves them out).
LOCAL_HEAL_FOLDERS = ("checkpoint_dir", "teacher_text_cache")


def check_corrections(linear_replacement: str | None, compensation: str | None, method: str, method_class: Any) -> None:
    """The refusals of a request's corrections (`FlattenConfig` and `optimum-flatten estimate` alike): each one's
    name and whether the method takes it (`_check_correction`), and never both at once."""
    _check_correction("linear_replacement", linear_replacement, ESTIMATORS, method, method_class)
    _check_correction("compensation", compensation, COMPENSATIONS, method, method_class)
    if linear_replacement is not None and compensation is not None:
        raise ValueError("compensation and linear_replacement both correct the stream at a cut; choose one of them.")


def _check_correction(option: str, value: Any, names: tuple[str, ...], method: str, method_class: Any) -> None:
    """Refuses an unknown correction name, or one the method cannot take, when the config is made.

    Every correction needs the method to leave cuts behind (not keep depth) and not to fit a map of its own; the
    compensation is also defined for dropped layers only, not merged ones.
    """
    if value is None:
        return
    if value not in names:
        raise ValueError(
            f"unknown {option} {value!r}.{did_you_mean(str(value), names)} Choose one of {list(names)} or None."
        )
    if method_class.keeps_depth:
        reason = "keeps every layer"
    elif not method_class.accepts_linear_replacement:
        reason = "fits its own linear replacement"
    elif option == "compensation" and method_class.merges_layers:
        reason = "merges layers, and Prune&Comp's factor is defined for dropped ones"
    else:
        return
    hint = (
        "replaceme takes estimator= instead"
        if option == "linear_replacement"
        else "use it with shortgpt, sleb or uidl, or linear_replacement for merging methods"
    )
    raise ValueError(f"{option} does not apply to method {method!r}: it {reason}. Drop {option} ({hint}).")


__all__ = [
    "COMPENSATIONS",
    "CONFIG_VERSION",
    "ESTIMATORS",
    "CalibrationConfig",
    "FlattenConfig",
    "LayerGroup",
    "LayerPlan",
    "MethodConfig",
    "check_option_types",
    "describe_dataset",
    "option_converter",
    "parse_method_options",
]


def _refuse_two_values(grouped: dict[str, Any], flat: dict[str, Any], group: str) -> None:
    """Refuses an option given both in `group` (``method_args=``, ``calibration=``) and as a keyword, with two
    values: one of them would be dropped without a word. The same value twice is accepted."""
    for key in sorted(grouped.keys() & flat.keys()):
        same = grouped[key] is flat[key]
        if not same:
            try:
                same = bool(grouped[key] == flat[key])
            except Exception:  # values without a plain equality (a dataset object): two objects are two values
                same = False
        if not same:
            raise ValueError(
                f"{key} is given twice, as {group}[{key!r}]={grouped[key]!r} and {key}={flat[key]!r}; give it once."
            )
