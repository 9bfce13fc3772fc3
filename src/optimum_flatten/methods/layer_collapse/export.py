"""Checkpoints of LayerCollapse models, whose MLPs no longer all have the shape the stock config describes.

A collapsed MLP is one (d x d) map in the up slot with the activation and down map replaced by the identity, an
un-collapsed one keeps ``up -> act -> down`` of the config's width, and a prepared (linearisable) one has a learned α
in its activation. Two formats, chosen per model:

- ``"stock"``: every MLP of every stack is collapsed, no α is left, and the family says under which config changes
  its stock class computes that (`mlp.collapsed_stock_config`: MLP width = hidden size, activation
  ``"linear"``, transformers' identity ``LinearActivation``). The down map is written as the identity with zero bias
  (``x·I + 0`` is exact in floating point); the checkpoint loads with the plain class (``GPT2LMHeadModel``,
  ``BertModel``, ``ViTForImageClassification``, ``MarianMTModel``). The identity costs d² + d parameters per layer
  on disk and in memory after reload. Marian has one activation for both stacks, so both must be fully collapsed;
  ``BertForMaskedLM``'s head reads ``hidden_act`` too, so it has no stock format.
- ``"remote_code"``: anything else (some MLPs collapsed, α left in the model, or a model the stock config cannot
  describe). The checkpoint plus a modelling file registered in ``auto_map`` (`remote_code`, the
  same file for every family); it loads with ``AutoModel...from_pretrained(path, trust_remote_code=True)`` and needs
  only torch and transformers. It is also the smallest checkpoint (no identity maps).

``"auto"`` (what `save_compressed` and `FlattenQuantizer.save` use) picks ``"stock"`` when it can express the model,
else ``"remote_code"``. `save_layer_collapse` lets the caller force either. Every write happens in a staging
directory renamed into place (`save_compressed`), and every refusal happens before anything is written.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...adapters import get_adapter
from ...adapters.reloaded import stock_classes, stock_model_type
from ...export.checkpoint import save_compressed
from .activation import ParametricActivation
from .config import METHOD_NAME
from .mlp import collapsed_stock_config, is_mlp_collapsed
from .reload import CONFIG_KEY, is_reloaded
from .remote_code import RemoteCodeUnavailableError, remote_layout, write_remote_code

FORMATS = ("auto", "stock", "remote_code")


@dataclass(frozen=True)
class LayerCollapseState:
    """Which MLPs of a model's stack are collapsed and which still carry a LayerCollapse α."""

    stack: str
    num_layers: int
    collapsed: tuple[int, ...]
    linearisable: tuple[int, ...]

    @property
    def is_present(self) -> bool:
        return bool(self.collapsed or self.linearisable)

    @property
    def fully_collapsed(self) -> bool:
        """Every MLP is one linear map and no α is left (the first condition of the stock format)."""
        return len(self.collapsed) == self.num_layers and not self.linearisable


class LayerCollapseExportError(ValueError):
    """A LayerCollapse model that the requested checkpoint format cannot describe (nothing is written)."""


def layer_collapse_states(model: nn.Module) -> list[LayerCollapseState]:
    """The LayerCollapse state of every stack of `model` (Marian has two), in the adapter's stack order."""
    adapter = get_adapter(model)
    states = []
    for stack in adapter.stacks():
        blocks = adapter.blocks(stack)
        collapsed = tuple(b.index for b in blocks if is_mlp_collapsed(b))
        linearisable = tuple(b.index for b in blocks if isinstance(b.mlp.activation, ParametricActivation))
        states.append(LayerCollapseState(stack, len(blocks), collapsed, linearisable))
    return states


def layer_collapse_state(model: nn.Module) -> LayerCollapseState | None:
    """The LayerCollapse state of the first stack of `model` that has one, or None when no MLP is collapsed or
    prepared in any stack (`layer_collapse_states` gives every stack)."""
    return next((state for state in layer_collapse_states(model) if state.is_present), None)


def stock_format_problem(model: nn.Module) -> str | None:
    """Why the stock format cannot describe `model`, or None when it can (see the module docstring)."""
    states = layer_collapse_states(model)
    if not all(state.fully_collapsed for state in states):
        found = "; ".join(
            f"{s.stack}: collapsed {list(s.collapsed)} of {s.num_layers} layers, alpha left in {list(s.linearisable)}"
            for s in states
        )
        return f"the stock format needs every MLP of every stack collapsed and no alpha left, got {found}"
    try:
        changes = collapsed_stock_config(get_adapter(model))
    except ValueError as error:  # the family has a stock format, but not for this model's heads
        return str(error)
    if changes is None:
        return f"model_type {model.config.model_type!r} has no stock LayerCollapse format (collapsed_stock_config)"
    return None


def check_export(model: nn.Module, export_format: str = "auto") -> str:
    """The format `model` would be written in (``"stock"`` or ``"remote_code"``), or the error saying why it cannot
    be; writes nothing.

    Raises:
        ValueError: an unknown format, or nothing collapsed or prepared.
        LayerCollapseExportError: ``"stock"`` asked for a model the stock config cannot describe, or a model whose
            class is not part of transformers (no remote code can subclass it).
    """
    if export_format not in FORMATS:
        raise ValueError(f"export_format must be one of {list(FORMATS)}, got {export_format!r}.")
    if layer_collapse_state(model) is None:
        raise ValueError("the model has no collapsed or linearisable MLP; save it with save_pretrained.")
    problem = stock_format_problem(model)
    if export_format == "stock" and problem is not None:
        raise LayerCollapseExportError(
            f"{problem}. Nothing was written; use export_format='remote_code' (or 'auto'), which loads with "
            "trust_remote_code=True, or collapse every MLP first."
        )
    if export_format == "stock" or (export_format == "auto" and problem is None):
        return "stock"
    try:
        remote_layout(model)
    except RemoteCodeUnavailableError as error:
        reason = "" if problem is None else f" ({problem})"
        raise LayerCollapseExportError(
            f"{error} The stock format does not apply either{reason}. Nothing was written; keep this model with "
            "torch.save(model.state_dict(), ...) and rebuild it in code."
        ) from error
    return "remote_code"


def write_layer_collapse_model(
    model: nn.Module, directory: str | Path, export_format: str = "auto", **save_kwargs: Any
) -> str:
    """Writes the weights, config.json (and for remote code the modelling file) of `model` into `directory`.

    Not atomic on its own: `save_compressed` calls it on its staging directory.

    Returns:
        The format written, ``"stock"`` or ``"remote_code"`` (recorded as ``export_format`` in the report).

    Raises:
        ValueError / LayerCollapseExportError: see `check_export`.
    """
    chosen = check_export(model, export_format)
    directory = Path(directory)
    if chosen == "stock":
        _write_stock(model, directory, save_kwargs)
    else:
        write_remote_code(model, directory, save_kwargs)
    return chosen


def save_layer_collapse(
    model: nn.Module,
    output_dir: str | Path,
    *,
    export_format: str = "auto",
    tokenizer: Any = None,
    report: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """`save_compressed` with a chosen format (``"auto"``, ``"stock"`` or ``"remote_code"``); atomic likewise."""
    if layer_collapse_state(model) is None:
        raise ValueError("the model has no collapsed or linearisable MLP; use save_compressed or save_pretrained.")
    # The writer refuses a bad format or an inexpressible model (check_export) before it writes anything, and
    # save_compressed removes its staging directory on any error.
    writer = functools.partial(write_layer_collapse_model, export_format=export_format)
    report = {"method": METHOD_NAME, **(report or {})}
    return save_compressed(model, output_dir, tokenizer=tokenizer, report=report, overwrite=overwrite, writer=writer)


# ------------------------------------------------------------------------------------------------------ stock
def stock_identity_parameters(model: nn.Module) -> int:
    """The parameters the stock format adds to `model` as it is in memory: an identity down map of d² + d for every
    collapsed MLP (`_write_stock`), which the checkpoint and its reload hold and `count_parameters(model)` does not."""
    adapter = get_adapter(model)
    widths = [b.mlp.up.out_features for stack in adapter.stacks() for b in adapter.blocks(stack) if is_mlp_collapsed(b)]
    return sum(width * width + width for width in widths)


def _identity_like(up: nn.Module, width: int) -> nn.Module:
    """A map computing ``x·I + 0`` (exact in floating point) of the up map's kind, dtype and device: an nn.Linear,
    or a GPT-2 Conv1D (its (in, out) storage of the symmetric I is the same tensor)."""
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        identity = Conv1D(width, width) if isinstance(up, Conv1D) else nn.Linear(width, width)
    options = {"dtype": up.weight.dtype, "device": up.weight.device}
    identity.weight = nn.Parameter(torch.eye(width, **options), requires_grad=False)
    identity.bias = nn.Parameter(torch.zeros(width, **options), requires_grad=False)
    return identity


def _write_stock(model: nn.Module, directory: Path, save_kwargs: dict[str, Any]) -> None:
    """Saves a fully collapsed model with an identity down map in every MLP, for the duration of the save only.

    Goes through the adapter views (the down slot of every block of every stack), so one writer serves every
    family; the config keys come from the adapter's `collapsed_stock_config`.
    """
    adapter = get_adapter(model)
    swapped: list[tuple[Any, nn.Module]] = []
    try:
        for stack in adapter.stacks():
            for block in adapter.blocks(stack):
                identity = _identity_like(block.mlp.up.module, block.mlp.up.out_features)
                swapped.append((block.mlp.down, block.mlp.down.swap_module_(identity)))
        model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    finally:
        for view, original in reversed(swapped):
            view.swap_module_(original)
    path = directory / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(collapsed_stock_config(adapter))
    if is_reloaded(model.config):  # back to the stock description: no remote code, no recorded paths
        model_class, _ = stock_classes(model)
        data.update(model_type=stock_model_type(model.config), architectures=[model_class.__name__])
        for key in ("auto_map", CONFIG_KEY):
            data.pop(key, None)
        for copied in directory.glob("modeling_layer_collapse_*.py"):  # save_pretrained copies the remote file
            copied.unlink()
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = [
    "FORMATS",
    "LayerCollapseExportError",
    "LayerCollapseState",
    "check_export",
    "layer_collapse_state",
    "layer_collapse_states",
    "save_layer_collapse",
    "stock_format_problem",
    "stock_identity_parameters",
    "write_layer_collapse_model",
]
