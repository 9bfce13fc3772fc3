"""The checks of ``FlattenConfig(heal=...)`` that need the compression's request (its method, corrections and the
layers it keeps), made in `FlattenQuantizer.preflight` before any weight changes: each of these used to be refused
by `recover` only after the compression, whose work was then lost."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..utils.positions import check_sequence_length
from .arguments import check_extra_training_args, check_in_memory, check_one_device_per_process, fsdp_version
from .lora import check_lora_targets
from .objectives import local_needs_one_process
from .precision import check_training_precision
from .rows import check_recovery_inputs


def check_healable(model: nn.Module, config: Any, layers: int) -> None:
    """The refusals of a model and its chosen mode that `recover` and `check_heal_request` both make, before any
    weight changes: one process seeing several GPUs, LoRA settings peft would refuse or merge wrong (`layers`: the
    healed model's), and weights too narrow to train in place. A check added here serves both doors."""
    check_one_device_per_process(model, config)
    check_extra_training_args(config)
    check_lora_targets(model, config, layers)
    check_training_precision(model, config)


def check_heal_request(
    model: nn.Module,
    tokenizer: Any,
    heal: tuple[Any, str, Any, str],
    method: Any,
    corrections: Any,
    kept: int,
    processes: int,
    in_place: bool = False,
) -> None:
    """Refuses a healing the compressed model could not run: `heal` is (training text, its column, the
    RecoveryConfig with its mode resolved, how it was chosen); `kept` the layers the compression keeps; `processes`
    the launch's; `in_place` whether the caller keeps the model it passed (compress-on-load), which a healing sharded
    by FSDP2 cannot give back (rank 0's whole model is another object)."""
    dataset, column, recovery, _ = heal
    check_in_memory(model)
    check_healable(model, recovery, kept)
    if in_place and fsdp_version(recovery) is not None:
        raise ValueError(
            "compress-on-load hands back the model transformers loaded, and a healing sharded by FSDP2 comes back "
            "whole on rank 0 only as another model: run `optimum-flatten compress --heal-tokens` under torchrun, or "
            "save the model FlattenQuantizer(config).compress(model, tokenizer) returns."
        )
    # A table too short is refused before the text is tokenised; a RoPE warning comes once, from `recover`.
    check_sequence_length(model, recovery.seqlen, "the heal's seqlen", warn=False)
    check_recovery_inputs(tokenizer, dataset, recovery, column)
    if recovery.mode == "local" and processes > 1:  # `recover` refuses it too, after the compression
        raise ValueError(local_needs_one_process(processes))
    if recovery.mode == "last_k" and recovery.last_k > kept:  # the compressed model's blocks, not these
        raise ValueError(
            f"heal mode 'last_k' trains the last {recovery.last_k} blocks, and the compressed model keeps {kept}; "
            f"lower last_k to at most {kept}."
        )
    if recovery.mode == "changed" and method.keeps_depth:
        raise ValueError(
            f"heal mode 'changed' trains the layers a depth compression merged or bridged, and {method.name} keeps "
            "every layer; heal with mode 'full', 'last_k' or 'lora'."
        )
    drops_only = not (method.merges_layers or corrections.linear_replacement or corrections.compensation)
    if recovery.mode == "changed" and drops_only and method.accepts_linear_replacement:
        # A method that only drops whole layers, uncorrected, leaves nothing that 'changed' could train; said now
        # rather than after the compression. (auto and ReplaceMe fit maps: they pass.)
        raise ValueError(
            f"heal mode 'changed' trains what the compression changed, and {method.name} without a correction only "
            "drops whole layers; add linear_replacement='lstsq_down' (its bridges are then trained), or heal with "
            "mode 'full', 'last_k' or 'lora'."
        )
