"""What LayerCollapse does to one MLP, through the adapter's views: swap its activation, collapse it into one map,
and say which stock config describes a model whose every MLP is collapsed.

These live with the method, not on the adapter, because no other method needs them: the adapter only knows that an
MLP can be stored as one map (`MlpView.is_single_map`), which its validation accepts, and the layout says which config
keys hold the MLP width and activation, from which `collapsed_stock_config` derives the stock description.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...adapters.base import ArchitectureAdapter
from ...adapters.views import BlockView
from ...utils.errors import UnsupportedArchitectureError


def replace_mlp_activation_(block: BlockView, module: nn.Module) -> None:
    """Puts `module` where the block's MLP activation is (the parametric activation while training, the identity
    once collapsed), found among the MLP module's submodules by identity, so every family whose activation is a
    module gets this without code of its own.

    Raises:
        ValueError: the activation is not a submodule of the MLP module.
    """
    activation = block.mlp.activation
    for name, child in block.mlp.module.named_modules():
        if name and child is activation:
            parent_name, _, attribute = name.rpartition(".")
            setattr(block.mlp.module.get_submodule(parent_name), attribute, module)
            return
    raise ValueError(
        f"layer {block.index}: the MLP activation ({type(activation).__name__}) is not a submodule of "
        f"{type(block.mlp.module).__name__}, so it cannot be replaced; LayerCollapse needs an activation module."
    )


def is_mlp_collapsed(block: BlockView) -> bool:
    """Whether the block's MLP was collapsed into one linear map (`collapse_mlp_` leaves an identity down map)."""
    return block.mlp.is_single_map


def collapse_mlp_(block: BlockView, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Replaces the block's MLP (up -> activation -> down) by the single map ``x @ weight.T + bias``.

    The merged (hidden, hidden) map goes into the up slot through its view (so ``nn.Linear`` and GPT-2's ``Conv1D``
    alike), and the activation and down slots become ``nn.Identity``: the MLP module, its forward and its
    state-dict names stay the architecture's (``...up.weight`` holds the merged map, the down map has no entry).
    Only exact when the activation is the identity (alpha = 1); the caller checks that.

    Raises:
        UnsupportedArchitectureError: for a gated MLP (gate·up is bilinear, never one linear map).
        ValueError: the MLP is already collapsed, or `weight` is not (hidden, hidden).
    """
    mlp = block.mlp
    if mlp.gate is not None:
        raise UnsupportedArchitectureError(
            f"layer {block.index}: a gated MLP cannot collapse into one linear map (gate(x)·up(x) is bilinear)."
        )
    if is_mlp_collapsed(block):
        raise ValueError(f"layer {block.index}: the MLP is already collapsed into one linear map.")
    hidden = mlp.up.in_features
    if tuple(weight.shape) != (hidden, hidden) or (bias is not None and tuple(bias.shape) != (hidden,)):
        raise ValueError(
            f"layer {block.index}: a collapsed MLP maps hidden={hidden} to hidden, got a weight of shape "
            f"{tuple(weight.shape)} and bias {None if bias is None else tuple(bias.shape)}; pass the (out, in) "
            "product W2·W1 of the down and up maps and W2·b1 + b2."
        )
    mlp.up.set_(weight, bias)
    replace_mlp_activation_(block, nn.Identity())
    mlp.down.swap_module_(nn.Identity())


def collapsed_stock_config(adapter: ArchitectureAdapter) -> dict[str, Any] | None:
    """Config changes under which the stock class describes the model once every MLP is collapsed, or None.

    From the layouts: each stack's MLP width key = hidden size and its activation key = ``"linear"`` (ACT2FN's
    identity); the export writes the down map as the identity. None for a family with a gated MLP (never one map).

    Raises:
        ValueError: a module outside the blocks also reads the activation key (BERT's masked-LM head transform), so
            ``"linear"`` would change it after a reload.
    """
    layouts = adapter.layouts
    if any(layout.mlp.gate is not None for layout in layouts):
        return None
    model = adapter.model
    readers = [
        name
        for name, module in model.named_modules()
        if any(hasattr(module, attribute) for attribute in adapter.activation_config_readers)
    ]
    keys = sorted({layout.mlp.activation_key for layout in layouts})
    if readers:
        current = {key: getattr(adapter.config, key, None) for key in keys}
        raise ValueError(
            f"a stock checkpoint of a fully collapsed model sets {keys} to 'linear', but {readers} of this "
            f"{type(model).__name__} also read it (now {current}), so the reloaded head would compute something "
            "else. Export the encoder alone (e.g. save model.bert), or a model whose heads do not read it "
            "(a sequence- or token-classification head)."
        )
    hidden = adapter.config.hidden_size
    changes: dict[str, Any] = {layout.mlp.width_key: hidden for layout in layouts}
    changes.update({key: "linear" for key in keys})
    return changes
