"""The model's own text as calibration rows (`CalibrationConfig.own_text`), sampled before it is compressed.

A method fits its maps and picks its layers on the calibration text alone, so what the compressed model keeps is
what that text exercises; rows the dense model writes itself exercise what it does on text in general, not only on
the user's genre. The rows come from the healing's sampler (`recovery.teacher_text`) on a stream of their own
(``"calibration"``, so never a healing run's rows): from the start token, temperature 1, no cut, seeded with the
calibration's seed. The start token is then dropped, leaving ``seqlen`` sampled tokens a row, because a packed
window of the dataset holds none either and its position's outsized activations would weigh in every second moment.
Where the rows are measured against the dataset alone: benchmarks/NOTEBOOK.md, "The model's own text in the
product's calibration".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compression.resume import OWN_TEXT
from ..options import CalibrationConfig
from .teacher_start import row_start
from .teacher_text import sample_teacher_rows

#: The sampler's stream for calibration rows: another stream than the healing's draws other rows with one seed.
STREAM = "calibration"


def own_row_count(config: CalibrationConfig) -> int:
    """How many of the ``nsamples`` rows the model writes: `own_text` of them, at least one, and one fewer than all
    (the option promises the dataset a share)."""
    return min(max(1, round(config.own_text * config.nsamples)), config.nsamples - 1)


def check_own_text(model: nn.Module, tokenizer: Any, config: CalibrationConfig) -> None:
    """Refuses, before any weight changes, a model that cannot write text (an encoder, a model without
    ``generate``) or a tokenizer with no start token: one line each."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        raise ValueError(
            f"own_text={config.own_text} needs a model that writes text (a causal LM with generate); "
            f"{type(model).__name__} does not: calibrate on the dataset alone (own_text=0)."
        )
    if tokenizer is None:
        raise ValueError(f"own_text={config.own_text} needs the model's tokenizer (its start token).")
    row_start(tokenizer, "bos")  # no BOS or EOS token: a one-line CalibrationDataError


def sample_own_rows(
    model: nn.Module,
    tokenizer: Any,
    config: CalibrationConfig,
    resume_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``[own_row_count(config), seqlen]`` token ids the model samples (see the module docstring), and the sampling's
    record (seconds, tokens a second, peak memory, whether read back, excerpts).

    With a `resume_dir` (``FlattenConfig(resume_dir=...)``) the rows are kept in its `OWN_TEXT` folder, so that a
    resumed job calibrates on the rows its first attempt read, without sampling them again.

    Under torch.distributed every rank samples every row, as one process would, before the calibration is shared
    out: the rows, and so the compression, are those of one process (sharing the sampling out would seed each
    share by its rank). A rank's seconds are then one process's, not a share of them."""
    check_own_text(model, tokenizer, config)
    opening = len(row_start(tokenizer, "bos")[0])
    was_training = model.training
    model.eval()
    try:
        rows, record = sample_teacher_rows(
            model,
            tokenizer,
            own_row_count(config),
            config.seqlen + opening,
            seed=config.seed,
            cache_dir=Path(resume_dir) / OWN_TEXT if resume_dir is not None else None,
            stream=STREAM,
            progress=progress,
            distributed=False,
        )
    finally:
        model.train(was_training)
    ids = torch.stack([row["input_ids"][opening:] for row in rows]).cpu()
    return ids, {"share": config.own_text, **record}
