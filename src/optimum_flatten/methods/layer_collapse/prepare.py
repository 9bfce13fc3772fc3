"""Step 1 of LayerCollapse: make the activation of the last MLPs learnably linear, and read back what is prepared.

`prepare_layer_collapse_` picks the MLPs through the architecture adapter (the last ones not collapsed yet);
`attach_parametric_activations_` does the same for explicit (parent module, attribute) pairs, for a model no adapter
serves. Both check everything before replacing anything, keep an activation that is already prepared (with its α),
and put α on the device of the weights around it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from ...adapters import get_adapter
from ...adapters.base import ArchitectureAdapter
from ...config import FlattenConfig
from ...utils.errors import UnsupportedArchitectureError
from .activation import ParametricActivation, make_parametric_activation
from .config import LayerCollapseConfig, resolve_config
from .mlp import is_mlp_collapsed, replace_mlp_activation_

logger = logging.getLogger(__name__)


def single_stack(adapter: ArchitectureAdapter, stack: str | None) -> str:
    """`stack`, checked to exist, or the model's only stack when None (LayerCollapse works on one at a time)."""
    stacks = adapter.stacks()
    if stack is None:
        if len(stacks) != 1:
            raise ValueError(f"this model has the stacks {stacks}; pass stack= to say which one to use.")
        return stacks[0]
    if stack not in stacks:
        raise ValueError(f"stack {stack!r} does not exist in this model; it has {stacks}.")
    return stack


# ------------------------------------------------------------------------------------------ reading state
def prepared_mlps(adapter: ArchitectureAdapter, stack: str) -> dict[int, ParametricActivation]:
    """Block index -> parametric activation of every MLP of `stack` that `prepare_layer_collapse_` linearised."""
    return {
        block.index: block.mlp.activation
        for block in adapter.blocks(stack)
        if isinstance(block.mlp.activation, ParametricActivation)
    }


def collapsed_mlp_indices(adapter: ArchitectureAdapter, stack: str) -> list[int]:
    """Indices of the blocks of `stack` whose MLP is already a single linear map."""
    return [block.index for block in adapter.blocks(stack) if is_mlp_collapsed(block)]


def check_not_gated(adapter: ArchitectureAdapter, indices: Sequence[int], stack: str) -> None:
    """Refuses gated MLPs: with the activation linearised, ``gate(x) ⊙ up(x)`` is still bilinear in x."""
    gated = [i for i in indices if adapter.block(stack, i).mlp.gate is not None]
    if gated:
        raise UnsupportedArchitectureError(
            f"LayerCollapse cannot collapse the MLPs of layers {gated}: model_type {adapter.config.model_type!r} has "
            "gated MLPs (down(act(gate(x)) * up(x)), e.g. SwiGLU). With the activation linearised the MLP still "
            "computes down(gate(x) * up(x)), an elementwise product of two linear maps of x: a bilinear "
            "(quadratic) function that no single linear map equals. LayerCollapse supports non-gated MLPs "
            "(GPT-2, and the BERT / ViT / Marian style up -> activation -> down); use a layer-dropping or merging "
            "method on this architecture."
        )


# ---------------------------------------------------------------------------------------------- prepare
def _planned(current: Any, alpha: float, where: str) -> tuple[ParametricActivation, bool]:
    """(activation, is new): an already prepared activation as it is, else a new one around `current`.

    Raises:
        TypeError: `current` is not an activation LayerCollapse can linearise; the message starts with `where`.
    """
    if isinstance(current, ParametricActivation):
        return current, False
    if type(current).__name__ == "LinearActivation" or isinstance(current, nn.Identity):
        # What a collapse saved in the stock format leaves (every MLP collapsed: `export`): an MLP whose activation
        # is already linear, which the refusal below would call an unsupported activation.
        raise TypeError(
            f"{where}: its MLP's activation is linear already (a collapse saved in the stock format leaves every MLP "
            "so): there is nothing left to linearise."
        )
    try:
        return make_parametric_activation(current, alpha), True
    except TypeError as error:
        raise TypeError(f"{where}: {error}") from error


def _on_device_of(activation: ParametricActivation, module: nn.Module) -> ParametricActivation:
    """`activation` moved to the device of `module`'s weights; α stays float32 (see the docs on bf16)."""
    reference = next(iter(module.parameters()), None)
    if reference is not None:
        activation.to(device=reference.device)
    return activation


def prepare_layer_collapse_(
    model: nn.Module,
    config: LayerCollapseConfig | FlattenConfig | None = None,
    *,
    stack: str | None = None,
    **options: Any,
) -> dict[int, ParametricActivation]:
    """Step 1: makes the activation of the last MLPs learnably linear (α = `initial_alpha`, 0 by default).

    The selection counts MLPs not collapsed yet, from the last block down (`LayerCollapseConfig.selected_indices`).
    Every check (architecture, gating, activation type, selection size) runs before any activation is replaced, so a
    refused request leaves the model unchanged. MLPs that are already prepared keep their α.

    Args:
        model: A model with an architecture adapter.
        config: A `LayerCollapseConfig`, or the `FlattenConfig(method="layer_collapse", ...)` you will compress with;
            None builds one from `options`.
        stack: The block stack (None: the model's only stack).
        **options: LayerCollapseConfig fields (``num_mlps=2`` or ``mlp_fraction=0.25``; ``initial_alpha``),
            overriding `config`.

    Returns:
        Block index -> its `ParametricActivation`, ascending; α is its ``alpha`` parameter (type `CollapseAlpha`).

    Raises:
        UnsupportedArchitectureError: no adapter for the model, or the selected MLPs are gated (SwiGLU).
        TypeError: an activation LayerCollapse cannot linearise (e.g. tanh), or a wrong config type.
        ValueError: no selection, or more MLPs than the stack has left un-collapsed.
    """
    cfg = resolve_config(config, options)
    adapter = get_adapter(model)
    stack = single_stack(adapter, stack)
    indices = cfg.selected_indices(adapter.num_layers(stack), collapsed_mlp_indices(adapter, stack))
    check_not_gated(adapter, indices, stack)
    blocks = [adapter.block(stack, i) for i in indices]
    planned = [_planned(block.mlp.activation, float(cfg.initial_alpha), f"layer {block.index}") for block in blocks]
    for block, (activation, is_new) in zip(blocks, planned, strict=True):
        if is_new:
            replace_mlp_activation_(block, _on_device_of(activation, block.mlp.module))
    logger.info("layer_collapse: linearisable activations in the MLPs of layers %s", indices)
    return {block.index: activation for block, (activation, _) in zip(blocks, planned, strict=True)}


def attach_parametric_activations_(
    targets: Sequence[tuple[nn.Module, str]], alpha: float = 0.0
) -> list[ParametricActivation]:
    """Replaces the activation modules named by (parent, attribute) pairs with parametric ones, in place.

    For a model no architecture adapter serves (`prepare_layer_collapse_` is the way for the others). Every pair is
    checked before anything is replaced, so a bad pair leaves the model untouched. A pair whose attribute already
    holds a ParametricActivation keeps it (attaching twice is harmless).

    Args:
        targets: (parent module, attribute name) pairs, e.g. ``[(block.mlp, "act") for block in gpt2.transformer.h]``.
        alpha: Initial α; 0 keeps every output unchanged.

    Returns:
        The parametric activations, in the order of `targets`.

    Raises:
        TypeError: a parent is not a module, or an activation is of an unsupported kind.
        ValueError: an attribute does not exist, or alpha is outside [0, 1].
    """
    planned: list[tuple[nn.Module, str, ParametricActivation, bool]] = []
    for parent, name in targets:
        if not isinstance(parent, nn.Module):
            raise TypeError(f"each target must be (nn.Module, attribute name), got parent {type(parent).__name__}.")
        if not hasattr(parent, name):
            raise ValueError(
                f"{type(parent).__name__} has no attribute {name!r}; name the attribute that holds the activation "
                f"(its child modules are {[child for child, _ in parent.named_children()]})."
            )
        planned.append((parent, name, *_planned(getattr(parent, name), alpha, f"{type(parent).__name__}.{name}")))
    for parent, name, module, is_new in planned:
        if is_new:
            setattr(parent, name, _on_device_of(module, parent))
    return [module for _, _, module, _ in planned]


__all__ = [
    "attach_parametric_activations_",
    "collapsed_mlp_indices",
    "prepare_layer_collapse_",
    "prepared_mlps",
]
