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
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from .ops.linear_map import ESTIMATORS
from .plan import LayerGroup, LayerPlan
from .utils.errors import InvalidTargetError, OptionTypeError, did_you_mean, reject_unknown_keys

logger = logging.getLogger(__name__)

#: Names of the corrections folded after a layer drop (see methods/compensation.py).
COMPENSATIONS = ("scale",)

CONFIG_VERSION = 1


@dataclass
class CalibrationConfig:
    """How much calibration text to use and how to cut it.

    Attributes:
        dataset: A list of strings, a path to a .txt/.jsonl/.json/.parquet file or a folder of .txt files, a
            `datasets.Dataset`, or a dataset name loaded through `datasets` (``"wikitext2"`` is WikiText-2 raw train,
            the paper's default; needs the network).
        nsamples: Number of calibration sequences (paper: 128).
        seqlen: Tokens per sequence (paper: 2048). The calibration size is ``nsamples * seqlen`` tokens.
        seed: Seed for choosing which windows of the text are used.
        batch_size: Sequences per forward call while calibrating; bounds activation memory, not the result.
        packing: True concatenates the texts and cuts non-overlapping ``seqlen`` windows (no padding, the
            paper's protocol). False keeps one text per row, truncated to ``seqlen`` and right-padded; padding
            is masked out of every statistic.
        text_column: Column holding the text in tabular inputs (jsonl, parquet, `datasets`).
    """

    dataset: Any = None
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    batch_size: int = 8
    packing: bool = True
    text_column: str = "text"

    def __post_init__(self) -> None:
        for name in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=8.")


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
        stacks: Which block stacks to compress (``["decoder"]`` for decoder-only LMs).
        layer_plan: Filled in after compression with the applied plan (provenance); not an input.
        tokenizer: Only for compress-on-load; never serialised.
        version: Config format version; a mismatch warns.
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
        **kwargs: Any,
    ) -> None:
        from .methods.registry import get_method_class

        self.quant_method = "flatten"
        if quant_method != "flatten":
            raise ValueError(f"FlattenConfig has quant_method 'flatten', got {quant_method!r}.")
        method_class = get_method_class(method)
        self.method = method
        self.num_layers_to_remove = num_layers_to_remove
        self.target_sparsity = target_sparsity
        self.stacks = list(stacks) if stacks is not None else None
        self.layer_plan = dict(layer_plan) if layer_plan is not None else None
        self.version = int(version)
        if self.version != CONFIG_VERSION:
            warnings.warn(
                f"FlattenConfig version {self.version} differs from this library's {CONFIG_VERSION}; "
                "fields may be interpreted differently.",
                stacklevel=2,
            )
        self._tokenizer = tokenizer
        _check_correction("linear_replacement", linear_replacement, ESTIMATORS, method, method_class)
        _check_correction("compensation", compensation, COMPENSATIONS, method, method_class)
        if linear_replacement is not None and compensation is not None:
            raise ValueError(
                "compensation and linear_replacement both correct the stream at a cut; choose one of them."
            )
        self.linear_replacement = linear_replacement
        self.compensation = compensation

        calibration_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _CALIBRATION_FIELDS}
        calibration = kwargs.pop("calibration", None)
        if isinstance(calibration, CalibrationConfig):
            calibration = dataclasses.asdict(calibration)
        if calibration:
            reject_unknown_keys(calibration, _CALIBRATION_FIELDS, "calibration")
            calibration_kwargs = {**calibration, **calibration_kwargs}
        self.calibration = CalibrationConfig(**calibration_kwargs)

        method_fields = {f.name for f in dataclasses.fields(method_class.config_class)}
        merged_args = dict(method_args or {})
        for key in list(kwargs):
            if key in method_fields:
                merged_args[key] = kwargs.pop(key)
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
                f"{num_layers - 1} can be removed. Choose a smaller target."
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
            "version": self.version,
        }

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """Rebuilds a config from `to_dict` output; unknown keys raise (with a did-you-mean hint)."""
        data = dict(config_dict)
        config = cls(**data, **kwargs)
        return (config, {}) if return_unused_kwargs else config

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlattenConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"FlattenConfig({self.to_dict()})"


_TOP_LEVEL_FIELDS = (
    "method",
    "num_layers_to_remove",
    "target_sparsity",
    "method_args",
    "stacks",
    "layer_plan",
    "tokenizer",
    "version",
    "quant_method",
    "calibration",
    "linear_replacement",
    "compensation",
)


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


def describe_dataset(dataset: Any) -> Any:
    """A JSON-friendly description of a calibration dataset (texts themselves are never serialised)."""
    if dataset is None or isinstance(dataset, (str, int, float)):
        return dataset
    if isinstance(dataset, (list, tuple)):
        return f"<{len(dataset)} texts>"
    return f"<{type(dataset).__name__}>"


def option_converter(hint: Any) -> tuple[Any, list[str] | None]:
    """(callable reading an option from text, its choices) for a config field's type hint.

    One reader for every place an option arrives as text (command-line flags, ``auto``'s candidate specs), so the
    type hints of the config dataclasses are the single definition of what an option accepts. Optional fields take
    the word ``none``; Literal fields list their choices.
    """
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return str, [str(v) for v in typing.get_args(hint)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            return str, None
        inner, choices = option_converter(args[0])
        return _or_none(inner), ([*choices, "none"] if choices else None)
    if hint is bool:
        return _parse_bool, None
    if hint in (int, float, str):
        return hint, None
    return str, None


def _or_none(convert: Any) -> Any:
    def parse(value: str) -> Any:
        return None if value.lower() == "none" else convert(value)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _parse_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


_parse_bool.__name__ = "true/false"


def parse_method_options(config_class: type, text: str, where: str) -> dict[str, Any]:
    """``"key=value,key=value"`` read into typed method options (unknown keys and bad values refused with `where`)."""
    hints = typing.get_type_hints(config_class)
    allowed = [f.name for f in dataclasses.fields(config_class)]
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{where}: option {item!r} needs the form key=value.")
        if key not in allowed:
            raise ValueError(f"{where}: unknown option {key!r}.{did_you_mean(key, allowed)} Allowed: {allowed}.")
        convert, choices = option_converter(hints[key])
        try:
            parsed = convert(value.strip())
        except ValueError as error:
            raise ValueError(f"{where}: option {key}={value!r}: {error}") from None
        if choices is not None and str(value.strip()) not in choices:
            raise ValueError(f"{where}: option {key}={value!r} is not one of {choices}.")
        options[key] = parsed
    return options


def check_option_types(config_class: type, data: Mapping[str, Any]) -> None:
    """Refuses a value whose type its field's hint does not admit, naming the option, the hint and the value.

    The hints are the one definition of what an option accepts (the command line and ``auto``'s candidate specs read
    text through them with `option_converter`); checking Python values against them here means a wrong type fails
    at config time with the option's name, not later inside a method with an opaque error. Ranges and relations
    between options stay in each config's ``__post_init__``. Hints this check does not describe (containers, custom
    classes) are left to the config.

    Raises:
        OptionTypeError: a value of the wrong type (bool is not accepted for int or float, int is accepted for
            float; a TypeError and a ValueError).
        ValueError: a value outside a ``Literal`` hint's choices.
    """
    hints = typing.get_type_hints(config_class)
    for key, value in data.items():
        if key not in hints or _admits(hints[key], value):
            continue
        message = f"{config_class.__name__}: {key} must be {_describe_hint(hints[key])}, got {value!r}"
        if typing.get_origin(_without_none(hints[key])) is typing.Literal:
            choices = [str(a) for a in typing.get_args(_without_none(hints[key]))]
            raise ValueError(f"{message}.{did_you_mean(str(value), choices)}")
        raise OptionTypeError(f"{message} ({type(value).__name__}).")


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _admits(hint: Any, value: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_admits(arg, value) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a hint this check does not describe: the config's own __post_init__ decides


def _describe_hint(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = [repr(a) for a in typing.get_args(hint)]
        return " or ".join(choices) if len(choices) <= 2 else "one of " + ", ".join(choices)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_hint(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return {bool: "True or False", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


@dataclass
class MethodConfig:
    """Base of every method's options: a dataclass that rejects unknown keys and values of the wrong type (read
    from the fields' type hints), and round-trips through dicts."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MethodConfig:
        reject_unknown_keys(data, [f.name for f in dataclasses.fields(cls)], f"{cls.__name__}")
        check_option_types(cls, data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = [
    "CONFIG_VERSION",
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
