"""Whether the healing's updates can land in the weights' own precision.

The Trainer steps on the weights in the dtype they were loaded in: it keeps no float32 copy of them, and it scales no
loss unless asked to (``fp16=True``, which refuses half-precision weights). Two consequences, checked before any
weight changes:

- float16 weights: the gradients overflow to inf/NaN without loss scaling (a tiny LLaMA's first step already gives
  ``grad_norm: nan``, and no weight changes); refused for the modes that train the weights themselves, as
  ``layer-collapse`` refuses float16.
- bfloat16 weights: an update smaller than half the rounding step of a weight (2^-9 of its magnitude, 8 bits of
  precision) rounds to no change. Adam's step is about the learning rate, so every weight larger than 512 x the rate
  in magnitude does not move at all; at the default rate that is most of them (on a tiny LLaMA, 7% of the weights
  changed in bfloat16 against 94% in float32, and the held-out objective fell 2% against 24%). Warned, with the
  numbers, since a model may fit a device only in bfloat16; loading it in float32 (``--dtype float32``) or healing
  with LoRA, whose adapters train in float32, avoids it.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..options.recovery import RecoveryConfig

#: Modes that train the model's own weights (LoRA trains float32 adapters beside them; 'none' trains nothing).
IN_PLACE_MODES = frozenset({"full", "changed", "last_k", "local"})

#: bfloat16 keeps 8 bits of precision: an update below 2^-9 of a weight's magnitude rounds away.
_BFLOAT16_HALF_STEP = 2.0**-9


def trained_dtypes(model: Any) -> set[str]:
    """The dtypes of the model's floating-point weights, by name (``"bfloat16"``): what its training steps round to."""
    return {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}


def check_training_precision(model: Any, config: RecoveryConfig) -> None:
    """Refuses float16 weights for a mode that trains them (see the module docstring), before any weight changes."""
    if config.mode in IN_PLACE_MODES and "float16" in trained_dtypes(model):
        raise ValueError(
            f"mode {config.mode!r} trains the model's float16 weights in place, whose gradients overflow without loss "
            "scaling (NaN at the first step); load the model in float32 or bfloat16 (on the command line --dtype), "
            "or heal with mode 'lora'."
        )


def precision_notes(model: Any, config: RecoveryConfig, rate: float, scale: float) -> list[str]:
    """A warning, also returned as a note for the log, when bfloat16 weights would round most of Adam's steps away:
    weights above 512 x `rate` in magnitude do not move, and `scale` (`rate.weight_scale`, the weight matrices'
    median RMS entry) is above that; else none."""
    if config.mode not in IN_PLACE_MODES or "bfloat16" not in trained_dtypes(model):
        return []
    frozen_above = rate / _BFLOAT16_HALF_STEP
    if scale <= frozen_above:
        return []
    note = (
        f"mode {config.mode!r} trains bfloat16 weights in place, and an update below 2^-9 of a weight rounds away: "
        f"at the learning rate {rate:.2g} no weight above {frozen_above:.2g} in magnitude moves, while the weight "
        f"matrices' median RMS entry is {scale:.2g}, so most steps will be lost. Load the model in float32 (on the "
        "command line --dtype float32) or heal with mode 'lora'."
    )
    warnings.warn(note, UserWarning, stacklevel=3)
    return [note]


__all__ = ["IN_PLACE_MODES", "check_training_precision", "precision_notes", "trained_dtypes"]
