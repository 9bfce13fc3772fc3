"""Domain errors.

Each subclasses ValueError or TypeError so callers that already catch those keep working, and each message says
what was wrong, what was received, what is allowed and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter, or the adapter cannot do what a method needs."""


class IndexSensitiveError(ValueError):
    """Renumbering layers would change the maths (the layer index enters the computation)."""


class OptionTypeError(TypeError, ValueError):
    """A method option of a type its hint does not admit. Both a TypeError (what it is) and a ValueError (what
    every other refusal of a bad option raises), so callers catching either see it."""


class InvalidTargetError(ValueError):
    """The compression target cannot be met for this model (e.g. removing every layer)."""


class CalibrationDataError(ValueError):
    """The calibration data is missing, unreadable or too small."""


class UnknownMethodError(ValueError):
    """No compression method is registered under the requested name."""


class OutputDirectoryError(ValueError):
    """The output directory exists and is not empty, and overwriting was not requested."""


class ModelSourceError(ValueError):
    """The model to load is not there: no such folder, not a checkpoint, an unreadable config, or not on the Hub."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Returns a ` Did you mean 'x'?` suffix when `name` is close to one of `choices`, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class NotCollapsibleError(ValueError):
    """An MLP was asked to collapse while its activation is still measurably nonlinear (|1 − α| ≥ threshold)."""


def reject_unknown_keys(data: Mapping[str, Any], allowed: Iterable[str], what: str) -> None:
    """Raises TypeError naming the unknown keys of `data`, with a did-you-mean and the allowed keys."""
    allowed = list(allowed)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise TypeError(
            f"{what} got unknown key(s) {unknown}.{did_you_mean(unknown[0], allowed)} Allowed: {sorted(allowed)}."
        )
