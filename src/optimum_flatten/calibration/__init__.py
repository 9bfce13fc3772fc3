"""Calibration: data -> token batches -> block-by-block capture -> float64 statistics."""

from .capture import LayerwiseRunner, capture_module_inputs
from .data import CalibrationBatch, build_calibration_batches, load_texts
from .stats import SecondMoment

__all__ = [
    "CalibrationBatch",
    "LayerwiseRunner",
    "SecondMoment",
    "build_calibration_batches",
    "capture_module_inputs",
    "load_texts",
]
