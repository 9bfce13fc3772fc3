"""What healing trains (the `mode`), and the layer map from the compression report's plan.

The plan (``report["plan"]``) lists, for each block of the compressed stack, the original layers it came from
(``groups``: ``[[0, 1], [2], [4]]``); a layer not listed was dropped. Student block k then stands for the original
layers from its first member up to the layer before the next block's first member (a dropped run belongs to the
block before it, since the next block reads what that block writes), the last block up to the original last layer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig
from ..plan import LayerPlan

logger = logging.getLogger(__name__)

MODES = ("lora", "changed", "local", "last_k", "full")


def check_mode(mode: str) -> None:
    """Raises ValueError naming the modes when `mode` is not one of them."""
    if mode not in MODES:
        raise ValueError(f"unknown recovery mode {mode!r}; choose one of {list(MODES)}.")


def report_plan(report: Mapping[str, Any] | None, num_blocks: int, missing: str) -> LayerPlan:
    """The compression's plan (`LayerPlan`) from the report, checked against the student's block count.

    Raises:
        ValueError: `missing` when the report holds no plan, or a plan that does not describe this model.
    """
    data = (report or {}).get("plan") or {}
    if not data.get("groups") or not data.get("num_layers"):
        raise ValueError(missing)
    plan = LayerPlan.from_dict(data)
    if plan.num_output_layers != num_blocks:
        raise ValueError(
            f"the report's plan has {plan.num_output_layers} blocks but the model has {num_blocks}; give the report "
            "of this checkpoint's compression."
        )
    return plan


def span_ends(groups: list[list[int]], num_layers: int) -> list[int]:
    """For each student block, the original layer that ends the span it stands for, inclusive (see the module
    docstring and `LayerPlan.span_ends`)."""
    return [end - 1 for end in LayerPlan(num_layers=num_layers, groups=groups).span_ends()]


def layer_map(report: Mapping[str, Any] | None, num_blocks: int) -> list[int]:
    """`span_ends` of the report's plan, checked against the student's block count.

    Raises:
        ValueError: without a plan in the report, or when the plan does not describe this model.
    """
    plan = report_plan(
        report,
        num_blocks,
        "hidden-state terms need the layer map of the compression report (flatten_report.json's 'plan'), and "
        "none was given; pass report=... (or recover a checkpoint folder that holds flatten_report.json), or set "
        "hidden_weight to 0.",
    )
    return span_ends(plan.group_lists(), plan.num_layers)


def changed_parameter_names(model: nn.Module, report: Mapping[str, Any] | None) -> list[str]:
    """Names of the parameters the compression touched: every parameter of a merged block, and the output
    projection (o / down) of each block carrying a linear bridge or a magnitude compensation.

    A compensation also scales the input embedding; it is left out here, since the embedding is most of a small
    model's parameters and training it is `full`'s job.

    Raises:
        ValueError: without a plan, or when the plan keeps only plain layers and nothing carries a correction.
    """
    _refuse_collapsed(report, "changed")
    adapter = get_adapter(model)
    blocks = adapter.blocks()
    plan = report_plan(
        report,
        len(blocks),
        "mode='changed' trains what the compression changed, which the compression report's plan says, and no "
        "report was given; pass report=... (flatten_report.json), or pick mode 'last_k', 'full' or 'lora'.",
    )
    wanted: set[int] = set()
    for k, group in enumerate(plan.groups):
        if not group.is_keep:
            wanted |= {id(p) for p in blocks[k].module.parameters()}
    bridged, compensated = _corrected_blocks(report, plan)
    for k in sorted(bridged | compensated):
        # What writes the MLP output (every expert's down projection in a mixture), and o for a compensation.
        wanted |= {id(p) for p in adapter.mlp_writers(blocks[k].module, k)}
        if k in compensated:
            wanted |= {id(p) for p in blocks[k].attention.o.module.parameters()}
    if not wanted:
        raise ValueError(
            "mode='changed' found nothing the compression changed: the plan only keeps or drops whole layers and no "
            "bridge or compensation was folded in; pick mode 'last_k', 'full' or 'lora'."
        )
    return [name for name, p in model.named_parameters() if id(p) in wanted]


@dataclass(frozen=True)
class Span:
    """One student block and the original layers it stands for (`LayerPlan.span_ends`), for mode 'local'.

    Attributes:
        block: The student block's index.
        start: The first original layer of the span: the layer after the previous block's span, so that the spans
            tile the original stack and a run of dropped layers *before* the first kept one belongs to block 0.
        end: The original layer after the span (exclusive); the teacher's state entering it is the target.
    """

    block: int
    start: int
    end: int


def changed_spans(model: nn.Module, report: Mapping[str, Any] | None) -> list[Span]:
    """The spans mode 'local' trains: every block that is not exactly one kept original layer with nothing folded in.

    That is a merged block, a kept block whose span covers dropped layers (so a plan that only drops layers, as
    ShortGPT's, has spans to train), and a block carrying a linear bridge or a magnitude compensation.

    Raises:
        ValueError: without a plan, or when every block is one plain original layer (nothing to train).
    """
    _refuse_collapsed(report, "local")
    blocks = get_adapter(model).blocks()
    plan = report_plan(
        report,
        len(blocks),
        "mode='local' trains each changed span towards the teacher's states at its ends, which the compression "
        "report's plan says, and no report was given; pass report=... (flatten_report.json), or pick mode 'last_k', "
        "'full' or 'lora'.",
    )
    ends = plan.span_ends()
    starts = [0, *ends[:-1]]
    bridged, compensated = _corrected_blocks(report, plan)
    spans = [
        Span(k, start, end)
        for k, (group, start, end) in enumerate(zip(plan.groups, starts, ends, strict=True))
        if not group.is_keep or end - start != 1 or k in bridged or k in compensated
    ]
    if not spans:
        raise ValueError(
            "mode='local' found no changed span: every block of the plan is one kept original layer with nothing "
            "folded in (the student is the teacher); there is nothing to heal."
        )
    return spans


def span_parameter_names(model: nn.Module, spans: list[Span]) -> list[str]:
    """Names of every parameter of the spans' student blocks (mode 'local' trains whole blocks)."""
    blocks = get_adapter(model).blocks()
    wanted = {id(p) for span in spans for p in blocks[span.block].module.parameters()}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


def _refuse_collapsed(report: Mapping[str, Any] | None, mode: str) -> None:
    """Refuses modes 'changed' and 'local' after LayerCollapse: its plan is the identity and its change, the collapsed
    MLPs, is recorded elsewhere (``report["layer_collapse"]``), so both would find nothing changed in a model that
    is not the teacher."""
    if isinstance((report or {}).get("layer_collapse"), Mapping):
        raise ValueError(
            f"mode={mode!r} reads the layers a depth compression merged, dropped or bridged, and a LayerCollapse "
            "model keeps every layer and changes its MLPs instead; heal it with mode 'full', 'last_k' or 'lora'."
        )


def _corrected_blocks(report: Mapping[str, Any] | None, plan: LayerPlan) -> tuple[set[int], set[int]]:
    """(student blocks carrying a linear bridge, student blocks a magnitude compensation scaled)."""
    bridged = {int(m["output_layer"]) for key in ("linear_replacement", "replaceme") for m in _maps(report, key)}
    return bridged, _compensated_blocks(report, plan)


def _maps(report: Mapping[str, Any] | None, key: str) -> list[dict[str, Any]]:
    entry = (report or {}).get(key)
    return list(entry.get("maps", [])) if isinstance(entry, Mapping) else []


def _compensated_blocks(report: Mapping[str, Any] | None, plan: LayerPlan) -> set[int]:
    """Student blocks whose output projections a 'scale' compensation multiplied (those before a dropped layer)."""
    entry = (report or {}).get("compensation")
    if not isinstance(entry, Mapping) or not entry.get("alpha"):
        return set()
    dropped = [int(k) for k in entry["alpha"]]
    return {k for k, first in enumerate(plan.first_indices) if any(d > first for d in dropped)}


def last_k_parameter_names(model: nn.Module, k: int) -> tuple[list[str], str | None]:
    """(names of the last `k` blocks', the final norm's and the LM head's parameters, a note on tying or None).

    With tied embeddings the LM head *is* the input embedding: training it changes both, and nothing is untied.
    """
    adapter = get_adapter(model)
    blocks = adapter.blocks()
    if not 1 <= k <= len(blocks):
        raise ValueError(f"last_k must be between 1 and the model's {len(blocks)} blocks, got {k}.")
    modules = [b.module for b in blocks[-k:]]
    for extra in (adapter.final_norm(), adapter.lm_head()):
        if extra is not None:
            modules.append(extra)
    wanted = {id(p) for module in modules for p in module.parameters()}
    note = None
    head, embeddings = adapter.lm_head(), adapter.embeddings()
    if (
        head is not None
        and embeddings is not None
        and getattr(head, "weight", None) is getattr(embeddings, "weight", 0)
    ):
        note = "the LM head is tied to the input embedding: training it changes the embedding too (nothing is untied)"
    return [name for name, p in model.named_parameters() if id(p) in wanted], note


def embedding_tables(model: nn.Module) -> list[nn.Parameter]:
    """The token embedding's and the LM head's weights, a tied table once (what `train_embeddings=False` freezes)."""
    tables = [getattr(m, "weight", None) for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    return list({id(t): t for t in tables if t is not None}.values())


def without_embeddings(model: nn.Module, names: list[str]) -> list[str]:
    """`names` less the token embeddings' and the LM head's parameters (`RecoveryConfig.train_embeddings=False`).

    Why it pays: the embedding is a large share of a small model's parameters (21% of SmolLM2-135M's, 62% of
    Gemma-3-270M's), and training it did not change the healed model measurably (options.recovery), while its
    gradient and Adam's two moments cost three times its bytes. Tied or not, both ends are left: an untied LM head is
    the same vocabulary-sized table."""
    frozen = {id(t) for t in embedding_tables(model)}
    wanted = set(names)
    return [name for name, p in model.named_parameters() if name in wanted and id(p) not in frozen]


def freeze_all_but_(model: nn.Module, names: list[str]) -> int:
    """Sets requires_grad to True on `names` only; returns the number of trainable parameters."""
    wanted = set(names)
    count = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in wanted)
        count += parameter.numel() if name in wanted else 0
    return count


def trained_parameters_(
    model: nn.Module, config: RecoveryConfig, report: Mapping[str, Any] | None, spans: list[Span], notes: list[str]
) -> tuple[nn.Module, Any]:
    """(the model the Trainer trains, its LoRA config or None): LoRA adapters around `model` for mode 'lora', else
    `model` with every parameter but the mode's frozen (the embeddings too where `config` keeps them frozen). Notes
    for the log are appended to `notes`."""
    from ..utils.launch import is_writer
    from .lora import wrap_lora

    if config.mode == "lora":
        return wrap_lora(model, config)
    if config.mode == "changed":
        names = changed_parameter_names(model, report)
    elif config.mode == "local":
        names = span_parameter_names(model, spans)
    elif config.mode == "last_k":
        names, note = last_k_parameter_names(model, config.last_k)
        notes += [note] if note and config.trains_embeddings else []
    else:
        names = [name for name, _ in model.named_parameters()]
    if not config.trains_embeddings:
        names = without_embeddings(model, names)
    trainable = freeze_all_but_(model, names)
    if is_writer():
        logger.info("mode %s: training %d parameters in %d tensors", config.mode, trainable, len(names))
    return model, None
