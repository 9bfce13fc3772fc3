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
from ..options.calibration import own_row_count as own_row_count  # the share's rule, with the option
from ..utils.errors import CalibrationDataError
from ..utils.launch import all_ranks_min, process_group
from .teacher_start import row_start
from .teacher_text import default_batch_size, sample_teacher_rows
from .teacher_text_cache import OtherJobsRows

#: The sampler's stream for calibration rows: another stream than the healing's draws other rows with one seed.
STREAM = "calibration"


def check_writes_text(model: nn.Module, own_text: float) -> None:
    """Refuses a model that cannot write text from a start token: one without ``generate`` (an encoder), or an
    encoder-decoder model, whose decoder writes from a source text it would be given none of (and whose rows would
    then calibrate its encoder). `estimate --own-text` asks it of the model built on meta."""
    can_generate = getattr(model, "can_generate", None)
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if encoder_decoder or not callable(can_generate) or not can_generate():
        what = "is an encoder-decoder model, which writes from a source text" if encoder_decoder else "does not"
        raise ValueError(
            f"own_text={own_text} needs a model that writes text (a causal LM with generate); "
            f"{type(model).__name__} {what}: calibrate on the dataset alone (own_text=0)."
        )


def check_own_text(model: nn.Module, tokenizer: Any, config: CalibrationConfig) -> None:
    """Refuses, before any weight changes, a model that cannot write text (`check_writes_text`) or a tokenizer with
    no start token: one line each."""
    check_writes_text(model, config.own_text)
    if tokenizer is None:
        raise ValueError(f"own_text={config.own_text} needs the model's tokenizer (its start token).")
    try:
        row_start(tokenizer, "bos")
    except CalibrationDataError:  # worded for the healing's sampler, which takes prompts instead
        raise CalibrationDataError(
            f"own_text={config.own_text} samples rows from the tokenizer's start token, and it has neither a BOS nor "
            "an EOS token: calibrate on the dataset alone (own_text=0)."
        ) from None


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
    share by its rank). Each batch draws from its own seed, so the ranks sample in batches of one size, the
    smallest their free memories allow. A rank's seconds are then one process's, not a share of them."""
    check_own_text(model, tokenizer, config)
    opening = len(row_start(tokenizer, "bos")[0])
    length = config.seqlen + opening
    was_training = model.training
    model.eval()
    try:
        rows, record = sample_teacher_rows(
            model,
            tokenizer,
            own_row_count(config),
            length,
            seed=config.seed,
            batch_size=_agreed_batch_size(model, length),
            cache_dir=Path(resume_dir) / OWN_TEXT if resume_dir is not None else None,
            stream=STREAM,
            progress=progress,
            distributed=False,
            one_job=True,  # the rows of the job in resume_dir: another seed or size is refused, not sampled over
        )
    except OtherJobsRows as refusal:  # its rows' length counts the start token; the user's --seqlen does not
        saved, now = ({**key, "seqlen": key["seqlen"] - opening} for key in (refusal.saved, refusal.now))
        raise OtherJobsRows(refusal.folder, refusal.name, saved, now) from None
    finally:
        model.train(was_training)
    ids = torch.stack([row["input_ids"][opening:] for row in rows]).cpu()
    return ids, {"share": config.own_text, **record}


def _agreed_batch_size(model: nn.Module, length: int) -> int | None:
    """Under torch.distributed, the smallest batch any rank's free memory allows, so that every rank samples the
    same rows; in one process None, the sampler's own rule (which a resumed sampling's kept batches inform)."""
    if process_group()[1] == 1:
        return None
    return all_ranks_min(default_batch_size(model, length))
