"""Healing a compressed model: LoRA or full-parameter training of what changed, on the LM loss or distilled from
the dense model (`distill`), behind a held-out gate (`gate`), with transformers' Trainer; merged into a plain model.

Importing this package does not import peft or datasets; `recover` does.
"""

from .data import load_recovery_texts
from .rows import check_recovery_inputs
from .selection import MODES
from .trainer import RecoveryConfig, recover

__all__ = ["MODES", "RecoveryConfig", "check_recovery_inputs", "load_recovery_texts", "recover"]
