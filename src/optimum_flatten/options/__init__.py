"""What can be asked: every option of a compression as torch-free declarations.

The calibration options, the names of the corrections, the options engine (type hints read as the one definition
of what an option accepts) and each method's options dataclass live here, below everything that computes, so that
`FlattenConfig`, the command line and the methods all read the same declarations, and the command line parses and
refuses arguments without importing torch or transformers (docs/cli.md).
"""

from .calibration import CalibrationConfig
from .corrections import COMPENSATIONS, ESTIMATORS
from .hints import MethodConfig, check_option_types, option_converter, parse_method_options

__all__ = [
    "COMPENSATIONS",
    "ESTIMATORS",
    "CalibrationConfig",
    "MethodConfig",
    "check_option_types",
    "option_converter",
    "parse_method_options",
]
