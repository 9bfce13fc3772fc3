"""Which job a compression's ``resume_dir`` belongs to: what `FlattenQuantizer.preflight` refuses before a resumable
compression starts, and the identity the folder's state must match (`compression.resume` keeps the state itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..config import FlattenConfig
from ..utils.fingerprint import weights_fingerprint
from .resume import ResumeState, calibration_fingerprint, job_identity

if TYPE_CHECKING:
    from .method import CompressionMethod
    from .pipeline import Corrections


def check_resumable(method: CompressionMethod, corrections: Corrections) -> None:
    """Refuses ``resume_dir`` where a resumed run could not rebuild the uninterrupted one's checkpoint: a method
    (or configuration) that saves no per-layer state, or a correction, which measures the dense model around the
    whole `apply_` and would have to be saved too.

    Raises:
        ValueError: one line, before calibration and before any weight changes.
    """
    refusal = method.resume_refusal()
    if refusal is not None:
        raise ValueError(f"resume_dir cannot be used here: {refusal}; drop resume_dir or change the method.")
    if corrections.linear_replacement is not None or corrections.compensation is not None:
        raise ValueError(
            "resume_dir cannot be used with linear_replacement or compensation: the correction is measured around the "
            "whole compression and is not saved per layer; drop one of them."
        )


def resume_identity(
    config: FlattenConfig,
    model: nn.Module,
    stack: str,
    num_layers: int,
    num_to_remove: int,
    batches: list[Any] | None,
) -> dict[str, Any]:
    """What a job in ``config.resume_dir`` must match (`compression.resume.job_identity`): the method's options, the
    share of the model's own rows (only where asked, so that older jobs' states still match), the depth target, the
    dense weights and the calibration batches (None before they exist: `ResumeState.check` then leaves them out)."""
    own = {"own_text": config.calibration.own_text} if config.calibration.own_text else {}
    options = {"method_args": config.method_args, "stacks": config.stacks, **own}
    calibration = config.calibration
    settings = ("dataset", "text_column", "nsamples", "seqlen", "batch_size", "seed")
    return job_identity(
        method=config.method,
        options=options,
        stack=stack,
        num_layers=num_layers,
        num_to_remove=num_to_remove,
        weights=weights_fingerprint(model),
        dtypes=[str(p.dtype) for p in model.parameters()],
        calibration=None if batches is None else calibration_fingerprint(batches),
        named={"options": options, "calibration": {name: getattr(calibration, name) for name in settings}},
    )


def open_resume_state(
    config: FlattenConfig, model: nn.Module, stack: str, num_layers: int, num_to_remove: int, batches: list[Any]
) -> ResumeState:
    """The job's state in ``config.resume_dir``, checked against this job (`resume_identity`): the method's options,
    depth target, dense weights and calibration batches must be the interrupted run's.

    Raises:
        ValueError: one line, when the folder holds another job's state (nothing is changed or deleted).
    """
    return ResumeState.open(
        config.resume_dir, resume_identity(config, model, stack, num_layers, num_to_remove, batches)
    )
