"""What the calibration layer reads from an architecture adapter, as a structural type.

Calibration sits below the adapters (adapters build calibration inputs, methods use both), so it cannot import
`ArchitectureAdapter`; it names the few members it calls instead. Every `ArchitectureAdapter` satisfies this protocol
(tests/test_import_graph.py checks it), so a method passes its adapter here unchanged and a type checker sees the
contract on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CalibrationAdapter(Protocol):
    """The adapter members `LayerwiseRunner` and the states engine use."""

    #: Whether the model's layer loop expects a tuple from each layer (stand-ins must answer in the same form).
    layer_output_is_tuple: bool

    def layers(self, stack: str | None = None) -> nn.ModuleList:
        """The stack's blocks, in order."""
        ...

    def base_model(self, stack: str | None = None) -> nn.Module:
        """The module whose forward runs the stack (its embeddings and layer loop)."""
        ...

    def embeddings(self) -> nn.Module:
        """The input embeddings (their device is where a forward starts)."""
        ...

    def forward_inputs(self, stack: str, batch: Any, device: torch.device) -> Mapping[str, Any]:
        """Keyword arguments of `base_model(stack)` for one calibration batch."""
        ...

    def token_mask(self, stack: str, batch: Any) -> torch.Tensor:
        """(batch, seq) mask of the stack's real positions."""
        ...

    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        """The norm before the LM head, if any."""
        ...

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """The output projection to the vocabulary (None for a stack without one)."""
        ...
