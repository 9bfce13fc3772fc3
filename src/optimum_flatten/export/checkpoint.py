"""Atomic save of a compressed model as an ordinary transformers checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..utils.errors import OutputDirectoryError
from ..utils.offload import is_offloaded

logger = logging.getLogger(__name__)

REPORT_NAME = "flatten_report.json"
HEATMAP_NAME = "similarity_heatmap.png"
#: Shard size when some weights are offloaded (transformers' default of 50 GB would onload them all at once).
OFFLOADED_SHARD_SIZE = "1GB"


def check_output_dir(output_dir: str | Path, overwrite: bool) -> Path:
    """Refuses a non-empty directory unless `overwrite`; call it before expensive work so nothing is wasted."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise OutputDirectoryError(f"output path {str(path)!r} exists and is a file; choose a directory path.")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputDirectoryError(
            f"output directory {str(path)!r} is not empty; choose another path or pass overwrite=True "
            "(--overwrite on the command line) to replace it."
        )
    return path


def save_compressed(
    model: nn.Module,
    output_dir: str | Path,
    tokenizer: Any = None,
    report: dict[str, Any] | None = None,
    overwrite: bool = False,
    writer: Callable[..., str] | None = None,
) -> Path:
    """Saves weights (safetensors), config, tokenizer, flatten_report.json, README.md and the heatmap.

    Everything is written into a temporary sibling directory that is renamed into place at the end; on any
    error the temporary directory is removed and an existing `output_dir` is left untouched.

    A model with LayerCollapse MLPs (collapsed or with α) is written by `export.layer_collapse`, which picks the
    stock format when it can and remote code otherwise; the format lands in the report as ``export_format``.
    `writer(model, directory, **save_kwargs) -> format name` replaces the weight/config writing (used by
    `save_layer_collapse` to force a format).
    """
    from .model_card import render_model_card
    from .plots import plot_similarity

    path = check_output_dir(output_dir, overwrite).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    report = dict(report or {})
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    from ..adapters import get_adapter
    from .layer_collapse import layer_collapse_states, loader_for, write_layer_collapse_model

    try:
        exported = get_adapter(model).export_model()
        # transformers onloads the offloaded weights one shard at a time: small shards keep the save within the
        # memory the compression needed.
        shards = {"max_shard_size": OFFLOADED_SHARD_SIZE} if is_offloaded(exported) else {}
        report.setdefault("architecture", type(exported).__name__)
        states = layer_collapse_states(exported)
        if any(state.is_present for state in states):
            report["mlp_layout"] = {
                state.stack: {"collapsed": list(state.collapsed), "linearisable": list(state.linearisable)}
                for state in states
            }
            if writer is None:
                writer = write_layer_collapse_model  # per-layer MLP shapes: no stock config describes them as they are
        if writer is None:
            exported.save_pretrained(staging, safe_serialization=True, **shards)
        else:
            report["export_format"] = writer(exported, staging, **shards)
            if report["export_format"] == "remote_code":
                report["load_with"] = loader_for(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if report.get("similarity") is not None:
            plot_similarity(report["similarity"], report.get("plan", {}).get("groups"), staging / HEATMAP_NAME)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (staging / "README.md").write_text(render_model_card(report), encoding="utf-8")
        _replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # From now on the saved directory is this model's base (what PEFT records in adapter_config.json).
    from ..quantizer import set_name_or_path

    set_name_or_path(model, str(path))
    logger.info("saved compressed model to %s", path)
    return path


def _replace_dir(staging: Path, path: Path) -> None:
    if path.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        backup.rmdir()
        path.rename(backup)
        try:
            staging.rename(path)
        except BaseException:
            backup.rename(path)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        staging.rename(path)
