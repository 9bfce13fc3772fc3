"""What ffn_merge's sharing saves, in the file and in memory, and how the model card says it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def parameter_footprint(model: nn.Module) -> tuple[int, int]:
    """(elements, bytes) of a model's unique parameters: tensors tied to one another count once.

    Before `tie_mlps_` this is what ``model.safetensors`` holds and a plain `from_pretrained` loads (the stock format
    has no way to say that two layers share one MLP, so each layer is written in full); after it, what the model
    occupies in memory. ffn_merge reports both, so no number claims a saving the file does not have.
    """
    seen: set[int] = set()
    elements = size = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            elements += parameter.numel()
            size += parameter.numel() * parameter.element_size()
    return elements, size


def parameters_text(report: Mapping[str, Any]) -> str | None:
    """The parameter counts as a plain reload has them: the file stores each shared MLP in full, so what it holds
    (and a plain `from_pretrained` loads) comes first, then what `retie_ffn_` leaves in memory, so no reader takes
    the smaller number for the checkpoint's size. Reports written before the method recorded its file count fall
    back to the count before compression (this method changes no tensor shape). None without both counts."""
    before, after = report.get("parameters_before"), report.get("parameters_after")
    if not isinstance(before, int) or not isinstance(after, int):
        return None
    in_file = report.get("ffn_parameters_in_file", before)
    in_memory = report.get("ffn_parameters_in_memory", after)
    text = f"{before:,} -> {in_file:,} in the checkpoint (model.safetensors, and a plain from_pretrained)"
    if in_memory != in_file:
        text += f"; {in_memory:,} in memory after retie_ffn_"
    file_bytes, memory_bytes = report.get("ffn_bytes_in_file"), report.get("ffn_bytes_in_memory")
    if isinstance(file_bytes, int) and isinstance(memory_bytes, int):
        text += f" (weights {_megabytes(file_bytes)} in the file"
        text += f", {_megabytes(memory_bytes)} in memory after retie_ffn_)" if memory_bytes != file_bytes else ")"
    return text


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"
