"""CoMe's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/come.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..hints import MethodConfig


@dataclass
class CoMeConfig(MethodConfig):
    """Options of CoMe.

    Attributes:
        fold_norms: Not in the paper (``False`` reproduces it: the merged layer's norms are the means of the two
            layers' norms, an approximation). ``True`` folds each layer's norm gains (and LayerNorm biases) into its
            own kept q/k/v and gate/up input columns and gives the merged norms unit gain, so the merged layer
            computes exactly the two pruned layers side by side on one input: what exact norm folding alone adds.
        allow_chaining: Whether an already merged layer may be merged again (the authors' code allows it by
            default; its ``--wo-repeat`` flag, used in their README example, is ``allow_chaining=False``).
        share_rounding: How a BI proportion becomes a whole number of KV groups and neurons: ``"nearest"``
            (largest remainder: each share rounded to the nearest unit) or ``"reference_code"`` (the authors' code:
            the smaller share rounded down, the larger takes the rest).
    """

    fold_norms: bool = False
    allow_chaining: bool = True
    share_rounding: Literal["nearest", "reference_code"] = "nearest"

    def __post_init__(self) -> None:
        for name in ("fold_norms", "allow_chaining"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.share_rounding not in ("nearest", "reference_code"):
            raise ValueError(f"share_rounding must be 'nearest' or 'reference_code', got {self.share_rounding!r}.")
