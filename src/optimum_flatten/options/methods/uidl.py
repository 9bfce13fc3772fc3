"""UIDL's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method (methods/uidl.py).

ReplaceMe selects its block the same way and extends these options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..hints import MethodConfig


@dataclass
class BlockSelectionConfig(MethodConfig):
    """Options of the contiguous-block selection.

    Attributes:
        tokens: ``"last"`` (each sequence's last real token, the paper's choice) or ``"all"`` real tokens.
        num_blocks: How many separate blocks share the removed layers (each ``num_layers_to_remove / num_blocks``).
    """

    tokens: Literal["last", "all"] = "last"
    num_blocks: int = 1

    def __post_init__(self) -> None:
        if self.tokens not in ("last", "all"):
            raise ValueError(f"tokens must be 'last' or 'all', got {self.tokens!r}.")
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}.")
