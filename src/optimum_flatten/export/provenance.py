"""Where a compressed model comes from, and what it must no longer claim: base name, licence, quantization config.

Kept apart from the quantizer so that the exporters (checkpoint, card, hub) can use it without importing the
orchestrator that imports them.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn


def set_name_or_path(model: nn.Module, value: str) -> None:
    """Sets both places transformers keeps it (the model attribute is a copy made at construction)."""
    model.config._name_or_path = value
    if hasattr(model, "name_or_path"):
        model.name_or_path = value


def base_license(name_or_path: str) -> str | None:
    """The `license:` of a local base checkpoint's model card front matter, to carry over (None if unknown)."""
    card = Path(name_or_path) / "README.md" if name_or_path else None
    if card is None or not card.is_file():
        return None
    lines = card.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if line.startswith("license:"):
            return line.split(":", 1)[1].strip() or None
    return None


def source_name_or_path(model: nn.Module) -> str:
    """Where the model was loaded from, as transformers records it (a Hub id or a local path; '' when unknown).

    Only for reading the base's licence: reports and cards name the base through `public_base_name`, which never
    gives an absolute local path.
    """
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")


def drop_own_quantization_config(model: nn.Module) -> None:
    """The compressed model is an ordinary model: it must not claim to need our quantizer to load."""
    qc = getattr(model.config, "quantization_config", None)
    method = getattr(qc, "quant_method", None) if not isinstance(qc, dict) else qc.get("quant_method")
    if method == "flatten":
        del model.config.quantization_config
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
