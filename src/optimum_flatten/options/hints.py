"""The options engine: a method's options are a dataclass, and its fields' type hints say what each accepts.

One reader for every place an option arrives as text (command-line flags, ``auto``'s candidate specs) and one type
check for options given as Python values, both read from the hints, so the dataclasses are the single definition.
This module imports neither torch nor transformers: the command line builds its flags from it and refuses a
misspelt flag before any heavy import.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..utils.errors import OptionTypeError, did_you_mean, reject_unknown_keys


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
        return _or_none(inner), (_ChoicesOrNone([*choices, "none"]) if choices else None)
    if hint is bool:
        return _parse_bool, None
    if hint in (int, float, str):
        return hint, None
    return str, None


class _ChoicesOrNone(list):
    """An Optional Literal's choices as argparse checks them: the converted value of ``none`` is None, which argparse
    looks for among the choices (and refused, naming the ``'none'`` it listed) after the conversion."""

    def __contains__(self, value: object) -> bool:
        return super().__contains__("none" if value is None else value)


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


def check_scoring_batches(value: Any) -> None:
    """The one check of a method's ``scoring_batches`` option: a positive integer, or None for every batch.

    A bool is refused although Python counts it as an int: ``scoring_batches=True`` would silently mean one batch.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"scoring_batches must be a positive integer or None, got {value!r}.")
