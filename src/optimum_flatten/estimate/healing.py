"""`estimate --heal`: the healing ``FlattenConfig(heal=...)`` / ``compress --heal-tokens`` runs after the compression,
with the mode it will train in chosen by the same check (`recovery.mode.compress_heal_mode`).

What the estimate adds with a heal:

- to every phase of the compression, the copy of the dense weights kept as the healing's teacher (taken before the
  first weight change, held until the healing ends);
- a phase ``healing``: what the default mode's check counted for the candidate it chose (the teacher copy, the
  training state of gradients and optimiser moments, one step's activations, or the teacher's text sampling where
  that is larger), above the resident weights. The check runs before the compression, on the dense model, so the
  student is counted at the dense model's size: a bound, as the run's own check is;
- the mode, the optimiser and the memory line of that check (JSON ``heal``), and what each fallback adds
  (``heal_fallbacks``), sized as the check sizes them.

The check needs the free memory of the device the healing trains on before the model is loaded: given
(``--free-memory-gib``), or read on this machine as the run would read it, less the dense weights the run loads first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from torch import nn

from ..compression.workspace import Phase, Term
from ..options.recovery import local_then_global
from ..recovery import footprint as memory_check
from ..recovery.footprint import (
    LEAN_OPTIMISERS,
    Budget,
    FullFootprint,
    candidate_footprints,
    host_training_device,
    lean_optimisers,
    sampling_bytes,
    weight_bytes,
)
from ..recovery.mode import compress_heal_mode

if TYPE_CHECKING:
    from ..options.recovery import RecoveryConfig
    from ..roofline import DeviceSpec
    from . import MemoryEstimate

GIB = 2**30

#: The phase the healing adds to an estimate (after the compression's, as it runs).
HEALING_PHASE = "healing"


def heal_budget(model: nn.Module, free_memory: int | None, device: DeviceSpec | None, asked: str = "--heal") -> Budget:
    """The memory the mode choice is given: `free_memory` bytes free before the model is loaded (read now on this
    machine's training device when None), less the dense weights the run loads first; a GPU with every lean optimiser
    where `device` names one and the memory is given, else this machine's device and optimisers (`asked`: the flag
    that needs it, for the refusal; `estimate.own_text.sampling_budget` asks it for a GPU the model samples on).

    Raises:
        ValueError: `device` named without `free_memory` on a machine with no GPU to read it from.
    """
    here = host_training_device()  # where the run trains the model it loads on this machine
    if free_memory is None:
        if device is not None and here.type != "cuda":
            raise ValueError(
                f"estimate {asked} with --device {device.name} needs --free-memory-gib: the memory free on that GPU "
                "before the model is loaded (about 79 on an 80 GB H100), since this machine has no GPU to read it "
                "from; what it holds follows it."
            )
        free, accelerator, optimisers, where = (
            memory_check.available_bytes(here),
            here.type == "cuda",
            lean_optimisers(),
            str(here),
        )
    elif device is not None:
        free, accelerator, optimisers, where = free_memory, True, list(LEAN_OPTIMISERS), device.name
    else:
        free, accelerator, optimisers, where = free_memory, here.type == "cuda", lean_optimisers(), str(here)
    return Budget(free - weight_bytes(model), accelerator, tuple(optimisers), where)


def with_healing(
    result: MemoryEstimate, model: nn.Module, healing: RecoveryConfig, budget: Budget, merges: bool
) -> MemoryEstimate:
    """`result` with the heal's teacher copy in every phase, the ``healing`` phase of the mode the run will choose
    (`compress_heal_mode` on the dense meta `model` within `budget`), and what each fallback adds. `merges`: the
    method merges layers, after which a default `full` trains `local` first (the same peak, later)."""
    resolved, choice = compress_heal_mode(model, healing, budget)
    copy = Term(
        "dense weights kept as the healing's teacher (heal=)",
        result.weights_bytes,
        "a copy taken before the compression's first weight change, held until the healing ends",
    )
    phases = [Phase(p.name, (*p.terms, copy)) for p in result.phases]
    phases.append(_healing_phase(resolved, choice.footprint, healing, weight_bytes(model)))
    notes = [*result.notes, _mode_note(resolved, choice.footprint, healing, merges)]
    # What the run records: after a plan that merged layers a default `full` trains `local` first, then the global
    # loss (`with_mode`'s split, made once the plan is known); the phase above keeps `full`'s footprint, the larger.
    # `compress --heal-tokens` always gives a token budget, which the split halves; its size changes nothing here.
    recorded = _as_recorded(resolved, healing, merges)
    heal = _choice_dict(recorded, choice.describe(recorded))
    if resolved.extra_training_args.get("optim") == "adamw_bnb_8bit":  # a GPU without bitsandbytes takes the next
        without = tuple(o for o in budget.optimisers if o != "adamw_bnb_8bit")
        other, other_choice = compress_heal_mode(model, healing, dataclasses.replace(budget, optimisers=without))
        other = _as_recorded(other, healing, merges)
        heal["without_bitsandbytes"] = _choice_dict(other, other_choice.describe(other))
        notes.append(f"heal: without bitsandbytes on the device: {_mode_words(other)}")
    candidates = candidate_footprints(model, healing, weight_bytes(model), budget.accelerator)
    notes.append(_fallbacks_note(candidates, sampling_bytes(model, healing)))
    full = candidates[0][1]
    heal.update(
        {
            "device": budget.where,
            "free_bytes": budget.free + weight_bytes(model),
            "free_with_the_model_loaded_bytes": budget.free,
            "footprint": None if choice.footprint is None else dataclasses.asdict(choice.footprint),
        }
    )
    return dataclasses.replace(
        result,
        phases=phases,
        notes=notes,
        heal=heal,
        heal_full={"state": full.state, "activations": full.activations},
        heal_fallbacks={
            "full_bytes": {name: f.state + f.activations for name, f in candidates},
            "sampling_bytes": sampling_bytes(model, healing),
        },
    )


def _choice_dict(resolved: RecoveryConfig, chosen: str) -> dict[str, Any]:
    """The choice as the run's log records it: mode, the lean optimiser (None: the Trainer's AdamW), whether the
    embeddings train (None: as the mode's default), and the memory lines behind it."""
    return {
        "mode": resolved.mode,
        "optimizer": resolved.extra_training_args.get("optim"),
        "train_embeddings": resolved.train_embeddings,
        "mode_chosen": chosen,
    }


def _mode_words(resolved: RecoveryConfig) -> str:
    """``mode='full' with AdamW`` (or the lean optimiser, and the embeddings frozen), as the notes say it."""
    how = [f"optimiser {resolved.extra_training_args['optim']}"] if resolved.extra_training_args.get("optim") else []
    how += ["the embeddings frozen"] if resolved.train_embeddings is False else []
    if resolved.mode == "local" and resolved.local_then_global_tokens is not None:
        return f"mode='local', then the global loss on {_GLOBAL_SCOPE[resolved.global_scope]}" + (
            f", with {' and '.join(how)}" if how else ""
        )
    if resolved.mode != "full":
        return f"mode='{resolved.mode}'"
    return f"mode='full' with {' and '.join(how) if how else 'AdamW'}"


#: What the global phase after `local` trains, by `RecoveryConfig.global_scope`, in the notes' words.
_GLOBAL_SCOPE = {"spans": "the same blocks", "all": "the whole model"}


def _as_recorded(resolved: RecoveryConfig, healing: RecoveryConfig, merges: bool) -> RecoveryConfig:
    """`resolved` as the run records it: after a plan that merged layers a default `full` trains `local` first, then
    the global loss (`with_mode`'s split, made once the plan is known); the footprint stays `full`'s, the larger."""
    if merges and healing.mode is None:
        return local_then_global(dataclasses.replace(resolved, max_tokens=resolved.max_tokens or 2))
    return resolved


def _healing_phase(
    resolved: RecoveryConfig, footprint: FullFootprint | None, healing: RecoveryConfig, teacher: int
) -> Phase:
    """The healing's workspace above the resident weights (the student, counted at the dense size): the chosen
    candidate's footprint, term by term; where nothing fitted, the `teacher` copy alone (`local` trains one changed
    block at a time, whose training state is not modelled)."""
    if footprint is None:
        copy = Term("teacher: the dense copy heal= keeps", teacher, "held until the healing ends")
        return Phase(f"{HEALING_PHASE} ({resolved.mode})", (copy,))
    terms = [Term("teacher: the dense copy heal= keeps", footprint.teacher, "held until the healing ends")]
    if footprint.sampling > footprint.state + footprint.activations:
        terms.append(Term("sampling the teacher's text", footprint.sampling, "one batch; freed before training"))
    else:
        step = f"{healing.per_device_train_batch_size} x {healing.seqlen} tokens"
        optimiser = resolved.extra_training_args.get("optim") or "AdamW"
        terms.append(Term(f"training state ({optimiser})", footprint.state, "gradients, optimiser moments, the step"))
        terms.append(Term(f"activations ({step} a step)", footprint.activations, "kept for the backward pass"))
    return Phase(HEALING_PHASE, tuple(terms))


def _mode_note(resolved: RecoveryConfig, footprint: FullFootprint | None, healing: RecoveryConfig, merges: bool) -> str:
    """What the healing will train, as the run's check decides it, and what its phase counts."""
    if footprint is None:
        return (
            f"heal: the default mode is '{resolved.mode}': full healing fits with none of its fallbacks; its phase "
            "counts the teacher copy only (local trains one changed block at a time, whose state is not modelled)"
        )
    text = (
        f"heal: {_mode_words(resolved)}, as compress --heal-tokens chooses it: {_gib(footprint.total)} above the "
        f"resident weights at "
        f"{healing.per_device_train_batch_size} x {healing.seqlen} tokens a step (the student counted at the dense "
        "model's size, as the choice before the compression counts it)"
    )
    if merges and healing.mode is None:
        text += (
            f"; after a plan that merged layers it trains 'local' first, then the global loss on "
            f"{_GLOBAL_SCOPE[healing.global_scope]} (counted at full's footprint, a bound)"
        )
    return text


def _fallbacks_note(candidates: list[tuple[str, FullFootprint]], sampling: int) -> str:
    """What each fallback of the default mode adds beside the resident weights and the teacher copy."""
    listed = "; ".join(f"{name} {_gib(full.state + full.activations)}" for name, full in candidates)
    return (
        f"heal: mode='full' adds beside the teacher copy, by the default's fallbacks in order: {listed} (8-bit AdamW "
        f"only with CUDA and bitsandbytes); sampling the teacher's own text first (recover's default text) holds "
        f"{_gib(sampling)} for one batch"
    )


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"
