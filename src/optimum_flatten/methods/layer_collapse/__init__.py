"""LayerCollapse (Shabgahi et al., "LayerCollapse: Adaptive Compression of Neural Networks", arXiv:2311.17943):
train the activation of the last MLPs towards the identity, then merge each MLP's two linear maps into one.

This package is the method's one public entry point: the command line, the examples and the benchmarks import every
step from ``optimum_flatten.methods.layer_collapse``. Unlike the other methods, LayerCollapse needs training between
its two steps, so the user flow has three parts:

1. ``prepare_layer_collapse_(model, num_mlps=2)`` (`prepare`) replaces the activation of the last ``num_mlps`` MLP
   blocks (or a fraction ``mlp_fraction`` of them) by a `ParametricActivation` (`activation`) at α = 0, which changes
   no output. Gated MLPs (SwiGLU: LLaMA, Qwen2, Mistral, Baichuan) are refused: with the SiLU linearised,
   ``gate(x) ⊙ up(x)`` is still a bilinear function of x, which no single matrix computes.
2. Fine-tune (`training`): ``train_to_linear(model, rows, LinearisationSchedule())`` runs the AdamLC pull-then-land
   schedule, or ``build_layer_collapse_trainer`` gives a `LayerCollapseTrainer` with the ``lc·Σ(1 − α)²``
   regulariser or the decoupled `AdamLC` optimizer for your own loop; both log every α.
3. ``FlattenQuantizer(FlattenConfig(method="layer_collapse", dataset=..., nsamples=...)).compress(model, tokenizer)``
   (`collapse`) collapses every prepared MLP whose ``|1 − α| < threshold`` (default 1e-4) into one linear map
   ``W = W2·W1``, ``b = W2·b1 + b2``, after measuring the error of doing so on calibration activations. One MLP above
   the threshold refuses the whole request (`NotCollapsibleError`, stating α), before anything is changed.
   ``collapse_prepared_mlps_(model)`` is the same step without the quantizer (and calibration optional).

Saving goes through `FlattenQuantizer.save` / `export.save_compressed`, which ask the method for its writer
(`export`: the stock format when the family's config can describe the model, else remote code, `remote_code`);
``save_layer_collapse`` forces a format. A remote-code checkpoint reloads with ``trust_remote_code=True`` and becomes
the in-memory model again on `get_adapter` (`reload`), so training and collapsing resume where they stopped.

The training names import `transformers.Trainer` (and through it datasets / peft when installed), so they are
resolved on first use: registering the method, which `FlattenQuantizer` does for every method, stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .activation import CollapseAlpha, ParametricActivation, make_parametric_activation, parametric_activations
from .collapse import (
    REPORT_KEY,
    LayerCollapseMethod,
    collapse_linearised_pair,
    collapse_prepared_mlps_,
    collapse_ready,
    measure_collapse_errors,
    require_all_ready,
    require_collapse_ready,
)
from .config import METHOD_NAME, LayerCollapseConfig
from .export import (
    FORMATS,
    LayerCollapseExportError,
    LayerCollapseState,
    check_export,
    layer_collapse_state,
    layer_collapse_states,
    save_layer_collapse,
    stock_format_problem,
    write_layer_collapse_model,
)
from .prepare import attach_parametric_activations_, collapsed_mlp_indices, prepare_layer_collapse_, prepared_mlps
from .reload import adopt_reloaded_
from .remote_code import RemoteCodeUnavailableError

if TYPE_CHECKING:
    from .training import (
        AdamLC,
        KeepEmbeddings,
        LayerCollapseTrainer,
        LinearisationSchedule,
        build_layer_collapse_trainer,
        collapse_penalty,
        mean_pooled,
        train_to_linear,
    )

#: Names of `training`, imported on first use (see the module docstring).
_TRAINING_NAMES = frozenset(
    {
        "AdamLC",
        "KeepEmbeddings",
        "LayerCollapseTrainer",
        "LinearisationSchedule",
        "build_layer_collapse_trainer",
        "collapse_penalty",
        "mean_pooled",
        "train_to_linear",
    }
)


def __getattr__(name: str) -> Any:
    if name in _TRAINING_NAMES:
        return getattr(importlib.import_module(f"{__name__}.training"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TRAINING_NAMES)


__all__ = [
    "FORMATS",
    "METHOD_NAME",
    "REPORT_KEY",
    "AdamLC",
    "CollapseAlpha",
    "KeepEmbeddings",
    "LayerCollapseConfig",
    "LayerCollapseExportError",
    "LayerCollapseMethod",
    "LayerCollapseState",
    "LayerCollapseTrainer",
    "LinearisationSchedule",
    "ParametricActivation",
    "RemoteCodeUnavailableError",
    "adopt_reloaded_",
    "attach_parametric_activations_",
    "build_layer_collapse_trainer",
    "check_export",
    "collapse_linearised_pair",
    "collapse_penalty",
    "collapse_prepared_mlps_",
    "collapse_ready",
    "collapsed_mlp_indices",
    "layer_collapse_state",
    "layer_collapse_states",
    "make_parametric_activation",
    "mean_pooled",
    "measure_collapse_errors",
    "parametric_activations",
    "prepare_layer_collapse_",
    "prepared_mlps",
    "require_all_ready",
    "require_collapse_ready",
    "save_layer_collapse",
    "stock_format_problem",
    "train_to_linear",
    "write_layer_collapse_model",
]
