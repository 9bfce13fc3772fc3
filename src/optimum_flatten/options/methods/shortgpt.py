"""ShortGPT's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/shortgpt.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hints import MethodConfig


@dataclass
class ShortGPTConfig(MethodConfig):
    """Options of ShortGPT.

    Attributes:
        iterative: Drop one layer per round and re-score the shortened model (with ``compensation="scale"``, after
            compensating each drop), as Prune&Comp's loop does; costs one pass per removed layer. False: the paper's
            single scoring pass.
    """

    iterative: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.iterative, bool):
            raise ValueError(f"iterative must be True or False, got {self.iterative!r}.")
