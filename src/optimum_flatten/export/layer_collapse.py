"""Checkpoints of LayerCollapse models, whose MLPs no longer all have the shape the stock config describes.

A collapsed MLP is one (n_embd x n_embd) map, an un-collapsed one keeps ``c_fc -> act -> c_proj`` of width
``n_inner``, and a prepared (linearisable) one has a learned α in its activation. Two formats, chosen per model:

- ``"stock"``: every MLP of the stack is collapsed and no α is left. Stock GPT-2 expresses that exactly:
  ``n_inner = n_embd``, ``activation_function = "linear"`` (transformers' identity ``LinearActivation``),
  ``c_fc`` = the collapsed map and ``c_proj`` = the identity with zero bias (``x·I + 0`` is exact in floating point).
  It loads with plain ``GPT2LMHeadModel.from_pretrained``. The identity costs n_embd² + n_embd parameters per layer
  on disk and in memory after reload.
- ``"remote_code"``: anything else (some MLPs collapsed, or α left in the model). The directory gets a small
  ``modeling_layer_collapse_gpt2.py`` (a `GPT2LMHeadModel` subclass that swaps the listed MLPs for one linear map
  and wraps the listed activations with their α) registered in config.json's ``auto_map``; it loads with
  ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` and needs only torch and transformers.

BERT, ViT and Marian (``nn.Linear`` MLPs) have the ``"stock"`` format only: every MLP of every stack collapsed is
written as the stock class with MLP width = hidden size, activation ``"linear"`` and an identity down map
(``intermediate_size`` / ``hidden_act`` for BERT and ViT; ``encoder_ffn_dim``, ``decoder_ffn_dim`` and the one
``activation_function`` for Marian, hence both stacks fully collapsed). A partly collapsed or mid-training model of
these families is refused (`LayerCollapseExportError`, nothing written): a remote-code file per family would have to
rebuild each one's blocks, and a partial collapse saves little next to collapsing every MLP; keep such a model with
``torch.save`` until it is fully collapsed.

``"auto"`` (what `save_compressed` and `FlattenQuantizer.save` use) picks ``"stock"`` when it can express the model,
else ``"remote_code"`` (GPT-2 only). `save_layer_collapse` lets the caller force ``"remote_code"`` (smallest
checkpoint: no identity maps). Every write happens in a staging directory renamed into place (`save_compressed`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..utils.errors import UnsupportedArchitectureError

MODELING_MODULE = "modeling_layer_collapse_gpt2"
REMOTE_MODEL_TYPE = "gpt2_layer_collapse"
REMOTE_CONFIG_CLASS = "LayerCollapseGPT2Config"
REMOTE_MODEL_CLASS = "LayerCollapseGPT2LMHeadModel"
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
        """Every MLP is one linear map and no α is left: what the stock GPT-2 format can express."""
        return len(self.collapsed) == self.num_layers and not self.linearisable


class LayerCollapseExportError(ValueError):
    """A LayerCollapse model that no checkpoint format of its family can describe (nothing is written)."""


def layer_collapse_states(model: nn.Module) -> list[LayerCollapseState]:
    """The LayerCollapse state of every stack of `model` (Marian has two), in the adapter's stack order."""
    from ..adapters import get_adapter
    from ..ops.parametric_activations import ParametricActivation

    adapter = get_adapter(model)
    states = []
    for stack in adapter.stacks():
        blocks = adapter.blocks(stack)
        collapsed = tuple(b.index for b in blocks if adapter.is_mlp_collapsed(b))
        linearisable = tuple(b.index for b in blocks if isinstance(b.mlp.activation, ParametricActivation))
        states.append(LayerCollapseState(stack, len(blocks), collapsed, linearisable))
    return states


def layer_collapse_state(model: nn.Module) -> LayerCollapseState | None:
    """The LayerCollapse state of the first stack of `model` that has one, or None when no MLP is collapsed or
    prepared in any stack (`layer_collapse_states` gives every stack)."""
    return next((state for state in layer_collapse_states(model) if state.is_present), None)


def check_stock_only_export(model: nn.Module, export_format: str = "auto") -> str:
    """The format for a family whose only LayerCollapse format is ``"stock"`` (BERT, ViT, Marian): ``"stock"``.

    Raises:
        ValueError: an unknown format.
        LayerCollapseExportError: ``"remote_code"`` asked for, or some MLP of some stack not collapsed (or α left).
    """
    if export_format not in FORMATS:
        raise ValueError(f"export_format must be one of {list(FORMATS)}, got {export_format!r}.")
    model_type = model.config.model_type
    states = layer_collapse_states(model)
    if export_format == "remote_code" or not all(state.fully_collapsed for state in states):
        found = "; ".join(
            f"{s.stack}: collapsed {list(s.collapsed)} of {s.num_layers} layers, with alpha {list(s.linearisable)}"
            for s in states
        )
        raise LayerCollapseExportError(
            f"model_type {model_type!r} has only the stock LayerCollapse checkpoint format, which needs every MLP of "
            f"every stack collapsed and no alpha left (export_format 'auto' or 'stock'); got export_format="
            f"{export_format!r} and {found}. Nothing was written. Either collapse every MLP (prepare_layer_collapse_ "
            "with num_mlps = the number of layers of each stack, train alpha to 1, collapse), or keep this model "
            "with torch.save(model.state_dict(), ...) and rebuild it in code; remote-code export exists for GPT-2 only."
        )
    return "stock"


def check_export(model: nn.Module, export_format: str = "auto") -> str:
    """The format `model` would be written in, or the error saying why it cannot be; writes nothing.

    Raises:
        UnsupportedArchitectureError: a family without any LayerCollapse format.
        ValueError: nothing collapsed or prepared, a bad format, or a model the family's formats cannot describe.
    """
    from ..adapters import get_adapter

    state = layer_collapse_state(model)
    if state is None:
        raise ValueError("the model has no collapsed or linearisable MLP; save it with save_pretrained.")
    model_type = getattr(model.config, "model_type", None)
    if model_type == "gpt2":
        return choose_format(state, export_format)
    try:
        changes = get_adapter(model).collapsed_stock_config()
    except ValueError as error:  # the family has a stock format, but not for this model's heads
        check_stock_only_export(model, export_format)  # a partial collapse is the first thing to fix: say that first
        raise LayerCollapseExportError(f"{error} Nothing was written.") from error
    if changes is None:
        raise UnsupportedArchitectureError(
            f"LayerCollapse checkpoints can be written for model_type 'gpt2', 'bert', 'vit' and 'marian' only, got "
            f"{model_type!r}; a format for this architecture (per-layer MLP shapes) has to be added in "
            "optimum_flatten.export.layer_collapse."
        )
    return check_stock_only_export(model, export_format)


def choose_format(state: LayerCollapseState, export_format: str = "auto") -> str:
    """The format a model in `state` is written in: ``"stock"`` or ``"remote_code"``.

    Raises:
        ValueError: an unknown format, or ``"stock"`` for a model the stock config cannot describe.
    """
    if export_format not in FORMATS:
        raise ValueError(f"export_format must be one of {list(FORMATS)}, got {export_format!r}.")
    if export_format == "auto":
        return "stock" if state.fully_collapsed else "remote_code"
    if export_format == "stock" and not state.fully_collapsed:
        raise ValueError(
            f"the stock format needs every MLP collapsed and no alpha left, got collapsed layers "
            f"{list(state.collapsed)} of {state.num_layers} and linearisable layers {list(state.linearisable)}; use "
            "export_format='remote_code' (or 'auto')."
        )
    return export_format


def write_layer_collapse_model(
    model: nn.Module, directory: str | Path, export_format: str = "auto", **save_kwargs: Any
) -> str:
    """Writes the weights, config.json (and for remote code the modelling file) of `model` into `directory`.

    Not atomic on its own: `save_compressed` calls it on its staging directory.

    Returns:
        The format written, ``"stock"`` or ``"remote_code"`` (recorded as ``export_format`` in the report).

    Raises:
        UnsupportedArchitectureError: a family without a LayerCollapse export (see `check_export`).
        ValueError: nothing is collapsed or prepared, a bad format, or (`LayerCollapseExportError`) a partly
            collapsed BERT / ViT / Marian model.
    """
    chosen = check_export(model, export_format)
    directory = Path(directory)
    if model.config.model_type != "gpt2":
        _write_stock_linear(model, directory, save_kwargs)
    elif chosen == "stock":
        _write_stock_gpt2(model, directory, save_kwargs)
    else:
        _write_remote_code_gpt2(model, directory, layer_collapse_state(model), save_kwargs)
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
    from .checkpoint import save_compressed

    if layer_collapse_state(model) is None:
        raise ValueError("the model has no collapsed or linearisable MLP; use save_compressed or save_pretrained.")
    check_export(model, export_format)  # refuse a bad format or an inexpressible model before anything is written
    writer = functools.partial(write_layer_collapse_model, export_format=export_format)
    return save_compressed(model, output_dir, tokenizer=tokenizer, report=report, overwrite=overwrite, writer=writer)


# ------------------------------------------------------------------------------------------------ GPT-2
def _gpt2_layers(model: nn.Module) -> nn.ModuleList:
    from ..adapters import get_adapter

    return get_adapter(model).layers("decoder")


def _identity_conv1d(like: nn.Module) -> nn.Module:
    """A Conv1D computing ``x @ I + 0`` in `like`'s dtype and device (the stock stand-in for "no c_proj")."""
    from transformers.pytorch_utils import Conv1D

    width = like.weight.shape[1]
    with torch.device("meta"):
        identity = Conv1D(width, width)
    options = {"dtype": like.weight.dtype, "device": like.weight.device}
    identity.weight = nn.Parameter(torch.eye(width, **options), requires_grad=False)
    identity.bias = nn.Parameter(torch.zeros(width, **options), requires_grad=False)
    return identity


def _rewrite_config(directory: Path, changes: dict[str, Any]) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_stock_gpt2(model: nn.Module, directory: Path, save_kwargs: dict[str, Any]) -> None:
    """Saves with an identity ``c_proj`` put in every (collapsed) MLP for the duration of the save only."""
    mlps = [layer.mlp for layer in _gpt2_layers(model)]
    originals = [mlp.c_proj for mlp in mlps]
    try:
        for mlp in mlps:
            mlp.c_proj = _identity_conv1d(mlp.c_fc)
        model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    finally:
        for mlp, original in zip(mlps, originals, strict=True):
            mlp.c_proj = original
    _rewrite_config(directory, {"n_inner": model.config.n_embd, "activation_function": "linear"})


# ------------------------------------------------------------------------ nn.Linear MLPs (BERT, ViT, Marian)
def _identity_linear(width: int, like: torch.Tensor) -> nn.Linear:
    """An nn.Linear computing ``x·I + 0`` (exact in floating point) in `like`'s dtype and device."""
    with torch.device("meta"):
        identity = nn.Linear(width, width)
    options = {"dtype": like.dtype, "device": like.device}
    identity.weight = nn.Parameter(torch.eye(width, **options), requires_grad=False)
    identity.bias = nn.Parameter(torch.zeros(width, **options), requires_grad=False)
    return identity


def _write_stock_linear(model: nn.Module, directory: Path, save_kwargs: dict[str, Any]) -> None:
    """Saves a fully collapsed model with an identity down map in every MLP, for the duration of the save only.

    Goes through the adapter views (the down slot of every block of every stack), so one writer serves every
    family with ``nn.Linear`` MLPs; the config keys come from the adapter's `collapsed_stock_config`.
    """
    from ..adapters import get_adapter

    adapter = get_adapter(model)
    swapped: list[tuple[Any, nn.Module]] = []
    try:
        for stack in adapter.stacks():
            for block in adapter.blocks(stack):
                identity = _identity_linear(block.mlp.up.out_features, block.mlp.up.weight)
                swapped.append((block.mlp.down, block.mlp.down.swap_module_(identity)))
        model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    finally:
        for view, original in reversed(swapped):
            view.swap_module_(original)
    _rewrite_config(directory, adapter.collapsed_stock_config())


def _write_remote_code_gpt2(
    model: nn.Module, directory: Path, state: LayerCollapseState, save_kwargs: dict[str, Any]
) -> None:
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    _rewrite_config(
        directory,
        {
            "model_type": REMOTE_MODEL_TYPE,
            "architectures": [REMOTE_MODEL_CLASS],
            "auto_map": {
                "AutoConfig": f"{MODELING_MODULE}.{REMOTE_CONFIG_CLASS}",
                "AutoModelForCausalLM": f"{MODELING_MODULE}.{REMOTE_MODEL_CLASS}",
            },
            "collapsed_mlp_layers": list(state.collapsed),
            "linearisable_mlp_layers": list(state.linearisable),
        },
    )
    (directory / f"{MODELING_MODULE}.py").write_text(REMOTE_GPT2_CODE, encoding="utf-8")


#: The modelling file written next to a partly collapsed GPT-2 checkpoint. It must not import optimum_flatten.
REMOTE_GPT2_CODE = f'''"""GPT-2 with per-layer MLP shapes, written by optimum-flatten for a LayerCollapse checkpoint.

Load it with transformers alone:

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

Every block is a stock GPT2Block except
- the blocks in `collapsed_mlp_layers`: their MLP is the single linear map `c_fc` (n_embd -> n_embd), the product
  of the MLP's two maps once its activation was trained to the identity (no activation, no `c_proj`);
- the blocks in `linearisable_mlp_layers`: their activation f becomes f(x) + alpha * (x - f(x)) with a learned alpha
  in [0, 1] (0 is the pretrained activation, 1 the identity).
"""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D


class {REMOTE_CONFIG_CLASS}(GPT2Config):
    model_type = "{REMOTE_MODEL_TYPE}"

    def __init__(self, collapsed_mlp_layers=None, linearisable_mlp_layers=None, **kwargs):
        self.collapsed_mlp_layers = [int(i) for i in (collapsed_mlp_layers or [])]
        self.linearisable_mlp_layers = [int(i) for i in (linearisable_mlp_layers or [])]
        super().__init__(**kwargs)


class LinearisableActivation(nn.Module):
    """f(x) + alpha * (x - f(x)), computed as lerp(f(x), x, alpha): exact at alpha = 0 and alpha = 1."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        alpha = self.alpha.clamp(0.0, 1.0).to(dtype=x.dtype, device=x.device)
        return torch.lerp(self.base(x), x, alpha)


class {REMOTE_MODEL_CLASS}(GPT2LMHeadModel):
    config_class = {REMOTE_CONFIG_CLASS}

    def __init__(self, config):
        super().__init__(config)
        for index in config.collapsed_mlp_layers:
            mlp = self.transformer.h[index].mlp
            mlp.c_fc = Conv1D(config.n_embd, config.n_embd)
            mlp.act = nn.Identity()
            mlp.c_proj = nn.Identity()
        for index in config.linearisable_mlp_layers:
            mlp = self.transformer.h[index].mlp
            mlp.act = LinearisableActivation(mlp.act)
        self.post_init()
'''


__all__ = [
    "FORMATS",
    "LayerCollapseExportError",
    "LayerCollapseState",
    "check_export",
    "check_stock_only_export",
    "choose_format",
    "layer_collapse_state",
    "layer_collapse_states",
    "save_layer_collapse",
    "write_layer_collapse_model",
]
