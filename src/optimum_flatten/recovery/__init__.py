"""Recovery fine-tuning of a compressed model: LoRA (peft) trained with transformers' Trainer, then merged.

Importing this package does not import peft or datasets; `recover` does.
"""

from .data import load_recovery_texts
from .trainer import RecoveryConfig, recover

__all__ = ["RecoveryConfig", "load_recovery_texts", "recover"]
