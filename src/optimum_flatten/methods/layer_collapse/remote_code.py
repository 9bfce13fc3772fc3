"""The remote-code checkpoint of a LayerCollapse model: per-layer MLP shapes in any family, for transformers alone.

No stock config can say "the MLP of layer 3 is one (d x d) map, the others keep their width", so a partly collapsed
model (or one still carrying a learned α) is written as the stock checkpoint plus a small modelling file:

- ``config.json`` gets ``model_type = "<stock>_layer_collapse"``, an ``auto_map`` entry for every Auto class that
  loads the saved class in transformers (``AutoModelForCausalLM`` for GPT-2, ``AutoModelForMaskedLM`` for
  ``BertForMaskedLM``, ``AutoModel`` for ``BertModel``, ``AutoModelForImageClassification`` for ViT,
  ``AutoModelForSeq2SeqLM`` for Marian, ...) and ``layer_collapse``: the module paths of every collapsed MLP's maps
  and of every α activation, read from the model through the adapter views.
- ``modeling_layer_collapse_<stock>.py`` subclasses the stock config and model classes. After the stock
  ``__init__`` it puts, at the recorded paths, one (d x d) map of the same kind (``nn.Linear`` or GPT-2's
  ``Conv1D``) where the up map was and ``nn.Identity`` where the activation and the down map were, and wraps each
  recorded activation in ``lerp(f(x), x, α)``. State-dict names then match the saved weights one for one.

Why paths rather than per-family code: the file is the same for every family, so a new adapter gets remote-code
export without code here; a family is only refused when its class (or config class) is not importable from
``transformers`` itself (a remote-code base model such as Baichuan, whose MLP is gated and never collapses anyway).
The modelling file imports torch and transformers only, never optimum_flatten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ...adapters import get_adapter
from ...adapters.reloaded import stock_classes, stock_model_type
from .activation import ParametricActivation
from .mlp import is_mlp_collapsed
from .reload import CONFIG_KEY, REMOTE_SUFFIX, is_reloaded


class RemoteCodeUnavailableError(ValueError):
    """The model's class or config class is not part of transformers, so no modelling file can subclass it."""


@dataclass(frozen=True)
class RemoteLayout:
    """Everything the modelling file and config.json need, computed from the model without writing anything."""

    stock_model_type: str
    stock_config_class: str
    stock_model_class: str
    auto_classes: tuple[str, ...]
    collapsed: tuple[dict[str, Any], ...]
    linearisable: tuple[str, ...]
    absent: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        return f"{self.stock_model_type}{REMOTE_SUFFIX}"

    @property
    def module_name(self) -> str:
        return f"modeling_layer_collapse_{self.stock_model_type}"

    @property
    def config_class(self) -> str:
        return f"LayerCollapse{self.stock_config_class}"

    @property
    def model_class(self) -> str:
        return f"LayerCollapse{self.stock_model_class}"

    def config_changes(self) -> dict[str, Any]:
        """The keys written over the stock config.json."""
        auto_map = {"AutoConfig": f"{self.module_name}.{self.config_class}"}
        auto_map.update({name: f"{self.module_name}.{self.model_class}" for name in self.auto_classes})
        return {
            "model_type": self.model_type,
            "architectures": [self.model_class],
            "auto_map": auto_map,
            CONFIG_KEY: {
                "collapsed": list(self.collapsed),
                "linearisable": list(self.linearisable),
                "absent": list(self.absent),
            },
        }

    def modeling_code(self) -> str:
        return _MODELING_TEMPLATE.format(
            stock_config_class=self.stock_config_class,
            stock_model_class=self.stock_model_class,
            config_class=self.config_class,
            model_class=self.model_class,
            model_type=self.model_type,
            config_key=CONFIG_KEY,
        )

    @property
    def loader(self) -> str:
        """The Auto class a user loads the checkpoint with (the most specific one transformers maps the class to)."""
        return self.auto_classes[0]


def auto_classes_for(model_type: str, name: str) -> tuple[str, ...]:
    """The transformers Auto classes that load the class called `name` for `model_type`, most specific first.

    Read from the Auto classes' own mappings, so a new head class needs no table here; ``AutoModel`` (the bare
    encoder) and ``AutoModelForPreTraining`` sort last because a task class says more about what the model does.
    """
    import transformers

    found = []
    for attribute in dir(transformers):
        if not attribute.startswith("AutoModel"):
            continue
        mapping = getattr(getattr(transformers, attribute, None), "_model_mapping", None)
        names = getattr(mapping, "_model_mapping", None) or {}
        entry = names.get(model_type)
        if entry == name or (isinstance(entry, (tuple, list)) and name in entry):
            found.append(attribute)
    generic = ("AutoModel", "AutoModelForPreTraining", "AutoModelForTextEncoding")
    return tuple(sorted(found, key=lambda auto: (auto in generic, generic.index(auto) if auto in generic else 0)))


def remote_layout(model: nn.Module) -> RemoteLayout:
    """The remote-code description of `model`'s LayerCollapse state (module paths through the adapter views).

    Raises:
        RemoteCodeUnavailableError: the model or config class is not importable from transformers, or no Auto
            class loads it.
    """
    import transformers

    model_class, config_class = type(model), type(model.config)
    if is_reloaded(model.config):  # reloaded from such a checkpoint: write the stock classes the file subclassed
        model_class, config_class = stock_classes(model)
    for kind, cls in (("model", model_class), ("config", config_class)):
        if getattr(transformers, cls.__name__, None) is not cls:
            raise RemoteCodeUnavailableError(
                f"the {kind} class {cls.__module__}.{cls.__name__} is not part of transformers "
                f"{transformers.__version__}, so the remote-code LayerCollapse format cannot subclass it."
            )
    autos = auto_classes_for(stock_model_type(model.config), model_class.__name__)
    if not autos:
        raise RemoteCodeUnavailableError(
            f"no transformers Auto class loads {model_class.__name__} for model_type {model.config.model_type!r}, so "
            "a remote-code checkpoint of it could not be loaded through auto_map; save the model whose head an Auto "
            "class knows (e.g. the ...ForCausalLM / ...ForMaskedLM / bare encoder class)."
        )
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    adapter = get_adapter(model)
    collapsed, linearisable = [], []
    for stack in adapter.stacks():
        for block in adapter.blocks(stack):
            mlp = block.mlp
            if is_mlp_collapsed(block):
                up = mlp.up.module
                collapsed.append(
                    {
                        "up": names[id(up)],
                        "activation": names[id(mlp.activation)],
                        "down": names[id(mlp.down.module)],
                        "kind": "conv1d" if _is_conv1d(up) else "linear",
                        "features": mlp.up.in_features,
                        "bias": mlp.up.bias is not None,
                    }
                )
            elif isinstance(mlp.activation, ParametricActivation):
                linearisable.append(names[id(mlp.activation)])
    return RemoteLayout(
        stock_model_type=stock_model_type(model.config),
        stock_config_class=config_class.__name__,
        stock_model_class=model_class.__name__,
        auto_classes=autos,
        collapsed=tuple(collapsed),
        linearisable=tuple(linearisable),
        absent=absent_modules(model, model_class),
    )


def absent_modules(model: nn.Module, stock_class: type) -> tuple[str, ...]:
    """Module paths the stock class builds from this config but the model holds as None (``BertModel`` built with
    ``add_pooling_layer=False``: the config does not record it, so a reload would add a random pooler).

    Found by building the stock class from the model's config on the meta device (no memory) and comparing.
    """
    import torch

    try:
        with torch.device("meta"):
            fresh = stock_class(model.config)
    except (TypeError, ValueError, AttributeError, RuntimeError):  # not buildable from its config alone: skip
        return ()
    present = {name for name, _ in model.named_modules(remove_duplicate=False)}
    absent = []
    for name, _ in fresh.named_modules():
        parent, _, attribute = name.rpartition(".")
        if not name or name in present or parent not in present or any(name.startswith(f"{a}.") for a in absent):
            continue
        if getattr(model.get_submodule(parent), attribute, False) is None:
            absent.append(name)
    return tuple(absent)


def write_remote_code(model: nn.Module, directory: Path, save_kwargs: dict[str, Any]) -> RemoteLayout:
    """Writes weights, the rewritten config.json and the modelling file of `model` into `directory`.

    The layout is computed (and refused, if need be) before anything is written.
    """
    layout = remote_layout(model)
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    path = directory / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(layout.config_changes())
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (directory / f"{layout.module_name}.py").write_text(layout.modeling_code(), encoding="utf-8")
    return layout


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


#: The modelling file; `str.format` fills the class names (literal braces are doubled).
_MODELING_TEMPLATE = '''"""{stock_model_class} with per-layer MLP shapes, written by optimum-flatten (LayerCollapse).

Load it with transformers alone (the Auto classes are listed in config.json's auto_map):

    model = AutoModel...from_pretrained(path, trust_remote_code=True)

The model is the stock {stock_model_class} except at the module paths listed in config.{config_key}:
- "collapsed": the MLP's up map is one (features x features) map, the product of the MLP's two maps once its
  activation was trained to the identity; its activation and down map are the identity.
- "linearisable": the activation f becomes f(x) + alpha * (x - f(x)) with a learned alpha in [0, 1] (0 is the
  pretrained activation, 1 the identity).
- "absent": modules the saved model did not have (e.g. a BertModel built without its pooler).
"""

import torch
from torch import nn
from transformers import {stock_config_class}, {stock_model_class}
from transformers.pytorch_utils import Conv1D


class {config_class}({stock_config_class}):
    model_type = "{model_type}"

    def __init__(self, {config_key}=None, **kwargs):
        self.{config_key} = {config_key} or {{"collapsed": [], "linearisable": [], "absent": []}}
        super().__init__(**kwargs)


class LinearisableActivation(nn.Module):
    """f(x) + alpha * (x - f(x)), computed as lerp(f(x), x, alpha): exact at alpha = 0 and alpha = 1."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        # Gradient 1 on the closed interval (torch.clamp gives 0 at the bounds from torch 2.14 on; alpha starts at 0).
        inside = (self.alpha >= 0) & (self.alpha <= 1)
        alpha = torch.where(inside, self.alpha, self.alpha.detach().clamp(0.0, 1.0)).to(dtype=x.dtype, device=x.device)
        return torch.lerp(self.base(x), x, alpha)


def _replace(root, path, module):
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class {model_class}({stock_model_class}):
    config_class = {config_class}
    # alpha stays float32 in a bfloat16 or float16 model: its training stops at 1 - 1e-4, which a half-precision
    # alpha cannot hold (and the value saved is the float32 one).
    _keep_in_fp32_modules_strict = sorted(set({stock_model_class}._keep_in_fp32_modules_strict or []) | {{"alpha"}})

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        layout = config.{config_key}
        for mlp in layout["collapsed"]:
            features = int(mlp["features"])
            if mlp["kind"] == "conv1d":
                merged = Conv1D(features, features)
            else:
                merged = nn.Linear(features, features, bias=bool(mlp["bias"]))
            _replace(self, mlp["up"], merged)
            _replace(self, mlp["activation"], nn.Identity())
            _replace(self, mlp["down"], nn.Identity())
        for path in layout["linearisable"]:
            _replace(self, path, LinearisableActivation(self.get_submodule(path)))
        for path in layout.get("absent", []):
            _replace(self, path, None)
        self.post_init()
'''


__all__ = [
    "RemoteCodeUnavailableError",
    "RemoteLayout",
    "auto_classes_for",
    "remote_layout",
    "write_remote_code",
]
