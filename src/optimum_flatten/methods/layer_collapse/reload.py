"""Models reloaded from LayerCollapse's remote-code checkpoints, made what they were in memory again.

A partly collapsed (or mid-training) LayerCollapse model is saved with a modelling file that subclasses the stock
class (`remote_code`): ``config.model_type`` is ``"<stock>_layer_collapse"``, the module layout is the stock one
except at the paths listed in ``config.layer_collapse``, and each α activation is the file's own
``LinearisableActivation`` (the file may not import optimum_flatten). To train, compress or save such a model again:

- the adapter registry serves it with its stock family's adapter (`adapters.reloaded.stock_model_type`: the config
  class subclasses the stock one), and asks every registered method to adopt it (`CompressionMethod.adopt_reloaded_`);
- `adopt_reloaded_` swaps each file-defined α activation for a `ParametricActivation` around the same base activation
  with the same α value. Both compute ``lerp(f(x), x, clamp(α, 0, 1))`` and keep the state-dict names (``...alpha``,
  ``...base``), so the function and the checkpoint layout do not change; what changes is that
  `LayerCollapseTrainer`, `AdamLC` (which tells α from weights by its parameter type) and the export see them;
- the export writes the stock classes again (`adapters.reloaded.stock_classes`), never the file's subclasses.

`get_adapter` adopts automatically, so `prepare_layer_collapse_`, `FlattenQuantizer.compress` and `save_compressed`
work on the reloaded model as on the in-memory one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .activation import ParametricActivation, make_parametric_activation
from .config import METHOD_NAME

#: config.json key holding the module paths the modelling file rewrites.
CONFIG_KEY = METHOD_NAME
#: Suffix of the model_type of a remote-code LayerCollapse checkpoint.
REMOTE_SUFFIX = f"_{METHOD_NAME}"


def is_reloaded(config: Any) -> bool:
    """Whether `config` belongs to a model loaded from a remote-code LayerCollapse checkpoint."""
    model_type = getattr(config, "model_type", None) or ""
    return model_type.endswith(REMOTE_SUFFIX) and getattr(config, CONFIG_KEY, None) is not None


def adopt_reloaded_(model: nn.Module) -> list[str]:
    """Swaps the α activations of a reloaded remote-code model for `ParametricActivation`s; returns their paths.

    Idempotent, and a no-op for any other model. Raises TypeError (from `make_parametric_activation`) if a recorded
    activation wraps something LayerCollapse cannot linearise, which a checkpoint written by optimum-flatten never
    holds.
    """
    config = getattr(model, "config", None)
    if not is_reloaded(config):
        return []
    adopted = []
    for path in getattr(config, CONFIG_KEY).get("linearisable", []):
        module = model.get_submodule(path)
        if isinstance(module, ParametricActivation) or not hasattr(module, "base"):
            continue
        replacement = make_parametric_activation(module.base)
        with torch.no_grad():
            replacement.alpha.data = module.alpha.detach().clone()  # the exact stored value, dtype and device
        replacement.alpha.requires_grad_(module.alpha.requires_grad)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, replacement)
        adopted.append(path)
    return adopted


__all__ = ["CONFIG_KEY", "REMOTE_SUFFIX", "adopt_reloaded_", "is_reloaded"]
