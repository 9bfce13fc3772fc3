"""Reading, writing and tying the feed-forward sublayers that ffn_merge shares between layers.

The merged MLP of a window is written into every member (`write_mlp_`) and the members are then tied to the
first (`tie_mlps_`): the same parameter tensors, so (k - 1) MLPs leave memory. A saved checkpoint stores every
layer in full so it loads with plain `from_pretrained`; `retie_ffn_` restores the sharing after such a reload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...ops.ffn_alignment import MlpWeights
from ...options.methods.ffn_merge import Window


# ---------------------------------------------------------------------------------------------- adapter I/O
def read_mlp(view: Any) -> MlpWeights:
    """The parameters of an adapter `MlpView` (every weight (out, in), as the views show them)."""
    return MlpWeights(
        up_weight=view.up.weight,
        up_bias=view.up.bias,
        gate_weight=None if view.gate is None else view.gate.weight,
        gate_bias=None if view.gate is None else view.gate.bias,
        down_weight=view.down.weight,
        down_bias=view.down.bias,
    )


def _fresh(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # `LinearView.set_` keeps a tensor that already has the right dtype and device, so every writer gets its own
    # storage unless sharing is what is meant.
    return None if tensor is None else tensor.clone()


def write_mlp_(view: Any, weights: MlpWeights) -> None:
    """Writes `weights` into an adapter `MlpView` through its `LinearView.set_` (own storage for this layer)."""
    view.up.set_(_fresh(weights.up_weight), _fresh(weights.up_bias))
    if view.gate is not None:
        view.gate.set_(_fresh(weights.gate_weight), _fresh(weights.gate_bias))
    view.down.set_(_fresh(weights.down_weight), _fresh(weights.down_bias))


def _linear_views(view: Any) -> list[Any]:
    return [v for v in (view.up, view.gate, view.down) if v is not None]


def check_same_layout(adapter: ArchitectureAdapter, stack: str, window: Window) -> None:
    """Raises when the MLPs of `window` cannot be averaged and tied (shapes, gate/bias presence, dtype, device)."""
    described = {}
    for i in window:
        mlp = adapter.block(stack, i).mlp
        params = [p for v in _linear_views(mlp) for p in v.module.parameters(recurse=False)]
        described[i] = (
            read_mlp(mlp).layout(),
            tuple(type(v.module).__name__ for v in _linear_views(mlp)),
            tuple(sorted({str(p.dtype) for p in params})),
            tuple(sorted({str(p.device) for p in params})),
        )
    first = described[window[0]]
    if any(d != first for d in described.values()):
        detail = "; ".join(f"layer {i}: {d}" for i, d in described.items())
        raise ValueError(
            f"cannot merge and tie the feed-forward sublayers of layers {list(window)}: their shapes, module types, "
            f"dtypes or devices differ ({detail}). Only identically shaped MLPs on one device can share parameters; "
            "choose other windows (window_starts) or merge before resizing MLPs."
        )


# ------------------------------------------------------------------------------------------------- tying
def tie_mlps_(adapter: ArchitectureAdapter, stack: str, window: Window) -> int:
    """Ties the MLPs of layers `window[1:]` to the MLP of `window[0]`; returns the parameter elements freed."""
    source = adapter.block(stack, window[0]).mlp
    freed = 0
    for i in window[1:]:
        target = adapter.block(stack, i).mlp
        for src, dst in zip(_linear_views(source), _linear_views(target), strict=True):
            freed += dst.share_parameters_of_(src)
    return freed


def _groups_from(report_or_groups: Any) -> list[tuple[str, Window]]:
    """Accepts a compression report (with ``ffn_groups``), its ``ffn_groups`` list, or plain lists of indices."""
    groups = report_or_groups.get("ffn_groups") if isinstance(report_or_groups, Mapping) else report_or_groups
    if groups is None or isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(
            "retie_ffn_ needs a report with 'ffn_groups' (flatten_report.json of an ffn_merge run), its "
            f"'ffn_groups' list, or lists of layer indices such as [[1, 2], [4, 5]]; got {type(report_or_groups)}."
        )
    parsed = []
    for group in groups:
        stack, layers = ("decoder", group) if not isinstance(group, Mapping) else (group["stack"], group["layers"])
        window = tuple(int(i) for i in layers)
        if len(window) < 2 or len(set(window)) != len(window):
            raise ValueError(f"a tied group needs at least two distinct layers, got {list(layers)}.")
        parsed.append((stack, window))
    return parsed


def _same_values(a: MlpWeights, b: MlpWeights) -> bool:
    """Bit-for-bit equality of two MLPs (a reloaded merged group is exactly equal; anything else is not a group)."""
    for field in dataclasses.fields(MlpWeights):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def retie_ffn_(model: nn.Module, report_or_groups: Any) -> int:
    """Restores the parameter sharing of an ffn_merge model reloaded with plain `from_pretrained`.

    A saved ffn_merge checkpoint stores every layer's MLP in full (so it loads anywhere); after loading, the k
    layers of a group hold equal but separate tensors. This makes them one tensor again, freeing (k - 1) MLPs.
    Everything is checked before anything is tied.

    Args:
        model: The reloaded model.
        report_or_groups: The compression report (``FlattenQuantizer.report`` or the saved flatten_report.json,
            loaded), its ``"ffn_groups"`` list, or lists of original 0-based layer indices of the decoder stack.

    Returns:
        The number of parameter elements freed.

    Raises:
        ValueError: when a group is out of range, its MLPs differ in layout, or their values are not identical
            (e.g. fine-tuned apart after reloading): tying them would silently change the model.
    """
    from ...adapters import get_adapter

    adapter = get_adapter(model)
    groups = _groups_from(report_or_groups)
    for stack, window in groups:
        num_layers = adapter.num_layers(stack)
        if not all(0 <= i < num_layers for i in window):
            raise ValueError(f"group {list(window)} is out of range for a {stack} stack of {num_layers} layers.")
        check_same_layout(adapter, stack, window)
        first = read_mlp(adapter.block(stack, window[0]).mlp)
        for i in window[1:]:
            other = read_mlp(adapter.block(stack, i).mlp)
            if not _same_values(first, other):
                raise ValueError(
                    f"the MLPs of layers {window[0]} and {i} are not identical, so they are not (or no longer) one "
                    "merged sublayer; retie only the groups listed by the ffn_merge report of this very checkpoint."
                )
    return sum(tie_mlps_(adapter, stack, window) for stack, window in groups)
