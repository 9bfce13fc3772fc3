"""`estimate --own-text`: the model writing its share of the calibration rows (`CalibrationConfig.own_text`) before
it is compressed.

The sampling runs in `FlattenQuantizer.preflight`, after every refusal and before the dense copy a heal keeps, so
its phase holds the resident weights and one sampling batch only: each row's KV cache at its full length (the start
token and ``seqlen`` sampled tokens) and a step's next-token logits (`recovery.teacher_text.kv_cache_bytes`,
``LOGIT_BYTES``). The batch is the one the sampler takes (`recovery.teacher_text.default_batch_size`): as many rows
as fit ``SAMPLING_HEADROOM`` of the memory free with the model loaded, at most ``MAX_BATCH_SIZE`` on a GPU and
``CPU_BATCH_SIZE`` on a CPU, and no more than there are rows, on the device the model is on (`sampling_budget`: host
memory for ``optimum-flatten compress``, which loads it there; the GPU ``--device`` names). The decoding's seconds
are not in the compute model: the note gives its sequential steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..compression.workspace import Phase, Term
from ..options import CalibrationConfig
from ..options.calibration import own_row_count
from ..recovery.footprint import Budget, host_training_device, weight_bytes
from ..recovery.teacher_text import (
    CPU_BATCH_SIZE,
    LOGIT_BYTES,
    MAX_BATCH_SIZE,
    SAMPLING_HEADROOM,
    device_batch_size,
    kv_cache_bytes,
)
from ..utils.memory import available_bytes

if TYPE_CHECKING:
    from ..roofline import DeviceSpec
    from . import MemoryEstimate

#: The phase the model's own calibration rows add to an estimate (before the compression's, as it runs).
OWN_TEXT_PHASE = "sampling the model's own calibration rows"

GIB = 2**30


def sampling_budget(model: nn.Module, free_memory: int | None, device: DeviceSpec | None) -> Budget:
    """Where the model writes its rows, and what is free there: the model samples where it is. With `device` named,
    on that GPU (the API or compress-on-load placing the model there; `free_memory` given for it, as
    `estimate.healing.heal_budget` asks). Else in host memory, where ``optimum-flatten compress`` loads the model:
    `free_memory` when this machine trains on its CPU too (so the one figure given is the host's), else read here."""
    if device is not None:
        from .healing import heal_budget

        return heal_budget(model, free_memory, device, "--own-text")
    if free_memory is None or host_training_device().type == "cuda":
        free_memory = available_bytes(torch.device("cpu"))
    return Budget(free_memory - weight_bytes(model), False, (), "cpu")


def own_text_phase(model: nn.Module, calibration: CalibrationConfig, budget: Budget) -> tuple[Phase, str]:
    """The sampling phase of `calibration` (with ``own_text`` > 0) on `model`'s shape, its batch sized within
    `budget` as the sampler sizes it, and the note that says how and what the decoding costs."""
    rows = own_row_count(calibration)
    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    length = calibration.seqlen + 1  # the start token, then seqlen sampled tokens (the start is dropped after)
    cache = kv_cache_bytes(model.config, length, element)
    vocab = int(model.config.get_text_config().vocab_size)
    logits = LOGIT_BYTES * vocab
    batch = min(rows, device_batch_size(cache, vocab, max(budget.free, 0), budget.accelerator))
    terms = (
        Term(f"KV cache ({batch} rows x {length} tokens)", batch * cache, "grows to the row's length as it samples"),
        Term(f"next-token logits ({batch} rows)", batch * logits, "one step's float32 scores, freed each step"),
    )
    steps = math.ceil(rows / batch) * calibration.seqlen
    note = (
        f"own_text={calibration.own_text}: the model samples {rows} of the {calibration.nsamples} calibration rows "
        f"first ({rows * calibration.seqlen:,} tokens, {steps:,} sequential decoding steps of {batch} rows at most; "
        f"their seconds are not in the compute model): as many rows a batch as fit {SAMPLING_HEADROOM:.0%} of the "
        f"{budget.free / GIB:.2f} GiB free on {budget.where} with the model loaded ({(cache + logits) / GIB:.3f} GiB a "
        f"row), at most {MAX_BATCH_SIZE if budget.accelerator else CPU_BATCH_SIZE}"
    )
    if budget.free <= 0:
        note += f"; the weights alone take more than the memory free on {budget.where}"
    return Phase(OWN_TEXT_PHASE, terms), note


def with_own_text(
    result: MemoryEstimate, model: nn.Module, calibration: CalibrationConfig, budget: Budget
) -> MemoryEstimate:
    """`result` with the own rows' sampling as its first phase (no heal copy in it: that copy is taken after)."""
    phase, note = own_text_phase(model, calibration, budget)
    return dataclasses.replace(result, phases=[phase, *result.phases], notes=[*result.notes, note])
