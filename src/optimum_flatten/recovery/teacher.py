"""The teacher of a distillation: which dense model, loaded how, and whether it speaks the student's vocabulary.

A teacher is a loaded model, a checkpoint folder, a bundled name (``smollm2``) or a Hub id. By default it is the
model the checkpoint was compressed from, when the compression report names it publicly (a bundled model's Hub
name loads the bundled copy, never the Hub); a local source must be given, since reports keep no local paths.

`recover` resolves and checks it in one step (`checked_teacher`), after every refusal that needs no teacher, so that
a run that cannot start never loads one. A new kind of teacher source is a branch of `load_teacher`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _bundled_key(name: str) -> str | None:
    """The bundled-model key `name` refers to (the key itself or its Hub name), else None."""
    from ..bundled import BUNDLED_MODELS

    if name in BUNDLED_MODELS:
        return name
    return next((key for key, spec in BUNDLED_MODELS.items() if spec.hub_name == name), None)


def default_teacher(report: Mapping[str, Any] | None) -> str | None:
    """The teacher the report names: its base model when that is a bundled model or a Hub id, else None."""
    base = str((report or {}).get("base_model") or "")
    if not base or base == "unknown":
        return None
    if _bundled_key(base) is not None or (report or {}).get("base_model_on_hub"):
        return base
    return None


def load_teacher(teacher: Any, dtype: torch.dtype) -> tuple[nn.Module, Any | None, str]:
    """(model, its tokenizer or None, a public description) of `teacher`, frozen, in eval, in `dtype`.

    Raises:
        TypeError: for a teacher that is neither a model nor a name.
        ModelSourceError: for a name that is neither a folder, a bundled name nor a Hub id.
    """
    tokenizer = None
    if isinstance(teacher, nn.Module):
        model, name = teacher, str(getattr(getattr(teacher, "config", None), "_name_or_path", "") or "<model>")
        from ..utils.causal_lm import transformers_class_name

        _check_causal_teacher(getattr(model, "config", None), name, transformers_class_name(model))
    elif isinstance(teacher, (str, Path)):
        key = _bundled_key(str(teacher))
        if key is not None:
            from ..bundled import load_bundled

            model, tokenizer = load_bundled(key, dtype=dtype)
            name = str(teacher)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

            from ..utils.loading import public_base_name, resolve_model_source

            source = resolve_model_source(teacher)
            config = AutoConfig.from_pretrained(source)
            _check_causal_teacher(config, str(teacher))  # before its weights load as a head it never had
            model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(source)
            name = public_base_name(str(teacher))[0]
    else:
        raise TypeError(
            f"teacher must be a model, a checkpoint folder, a bundled name or a Hub id, got {type(teacher).__name__}."
        )
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if next(model.parameters()).dtype != dtype:
        model.to(dtype=dtype)
    return model, tokenizer, name


def _check_causal_teacher(config: Any, name: str, architecture: str | None = None) -> None:
    """Refuses a teacher that is not a causal LM (`utils.causal_lm`): `AutoModelForCausalLM` loads BERT as a
    `BertLMHeadModel` that sees the tokens it should predict, and Marian as a decoder with a fresh head, and either
    distils without an error into a student that learns nothing true."""
    from ..utils.causal_lm import non_causal_description

    what = None if config is None else non_causal_description(config, architecture)
    if what is not None:
        raise ValueError(
            f"the teacher must be a causal language model (the student learns its next-token distributions), and "
            f"{name} is {what}; pass the dense causal LM the student was compressed from."
        )


#: Text every teacher's tokenizer must encode as the student's does: letters, digits, punctuation, whitespace and
#: common words, so that two tokenizers of one size but another order of their tokens differ on it.
PROBE = (
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX, 0123456789!\n"
    'It was the best of times; it was the worst of times? (And then: "what next" - said she.)\t'
    "Mr. Smith's report, page 42: 3.14 + 2 = 5.14 & 100% of [items] {done} <ok> #tag @user ~/path_to/file.txt"
)


def check_compatible(
    student: nn.Module, teacher: nn.Module, tokenizer: Any, teacher_tokenizer: Any | None, texts: list[str]
) -> None:
    """Refuses a teacher whose logits do not index the student's tokens.

    The vocabulary sizes (the output embeddings' rows) must be equal, and when the teacher's tokenizer is known it
    must encode the first training texts, and `PROBE`, to the same ids: the probe is what a healing on the
    teacher's own text (no training text) is checked on, where the teacher's ids become the student's rows.

    Raises:
        ValueError: one line naming what differs.
    """
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"the teacher's vocabulary has {sizes[1]} entries and the student's {sizes[0]}: a KL between their "
            "next-token distributions would compare different tokens; give the dense model the checkpoint was "
            "compressed from as the teacher."
        )
    if teacher_tokenizer is None:
        return
    for text in [*texts[:8], PROBE]:
        sample = text[:2000]
        ours = list(tokenizer(sample, add_special_tokens=False)["input_ids"])
        theirs = list(teacher_tokenizer(sample, add_special_tokens=False)["input_ids"])
        if ours != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
            )
            raise ValueError(
                f"the teacher's tokenizer encodes {'a probe' if text is PROBE else 'the training'} text differently "
                f"from the student's (first difference "
                f"at token {at}); distillation needs the same tokens: give the dense model the checkpoint was "
                "compressed from as the teacher."
            )


def check_teacher_depth(student: nn.Module, teacher: nn.Module, report: Mapping[str, Any] | None, config: Any) -> None:
    """Refuses a teacher that cannot be the dense model the student was compressed from: the student itself, one
    shallower than the student (the two given the other way round), or, where the report's plan maps the student's
    blocks onto the teacher's layers (mode 'local', hidden-state terms), one of another depth than the plan's. Each
    healed without a word (or with the fingerprint's warning only) towards a model that is not the dense one.
    """
    from ..utils.fingerprint import weights_fingerprint

    ours, theirs = (m.config.get_text_config().num_hidden_layers for m in (student, teacher))
    given = "give the dense model the checkpoint was compressed from as the teacher"
    # Only a teacher of the student's depth can hold its weights: the common, deeper teacher is not fingerprinted.
    if teacher is student or (theirs == ours and weights_fingerprint(teacher) == weights_fingerprint(student)):
        raise ValueError(f"the teacher is the model being healed (the same weights); {given}.")
    if theirs < ours:
        raise ValueError(
            f"the teacher has {theirs} layers, fewer than the {ours} of the model it would heal: were the compressed "
            f"checkpoint and the teacher given the other way round? {given[0].upper()}{given[1:]}."
        )
    planned = (report or {}).get("num_layers_before")
    if isinstance(planned, int) and theirs != planned and (config.mode == "local" or config.hidden_weight > 0):
        raise ValueError(
            f"the report's plan maps the model's blocks onto {planned} original layers, and the teacher has {theirs}: "
            f"mode 'local' and hidden-state terms train each block towards the teacher's state at its layer; {given}."
        )


def check_source(teacher: nn.Module, report: Mapping[str, Any] | None, stacklevel: int = 3) -> str | None:
    """A warning (also returned for the log) when `teacher` is not the model the checkpoint was compressed from.

    The report keeps a fingerprint of the dense weights (`utils.fingerprint`), not their path; a teacher whose
    fingerprint differs is another model (another fine-tune, another size, the same name on another revision).
    Distilling from it is allowed, since it may be what the user wants, but it is said. None when the teacher
    matches, or when the report has no fingerprint (a report written before it existed). `stacklevel` is the
    warning's, counted from here: 3 names the caller of the function that called this one.
    """
    from ..utils.fingerprint import weights_fingerprint

    expected = (report or {}).get("source_fingerprint")
    if not expected or weights_fingerprint(teacher) == expected:
        return None
    message = (
        "the teacher is not the model this checkpoint was compressed from (its weights' fingerprint differs from "
        "the report's source_fingerprint); distilling from it anyway"
    )
    # A warning only, not a log record too: the command line prints both, and the user read the same line twice.
    warnings.warn(message, stacklevel=stacklevel)
    return message


#: Refusals of a healing that needs a teacher and has none, shared by the steps that find it out first.
_TEXT_NEEDS_TEACHER = (
    "teacher text (dataset='teacher' or teacher_text > 0) is sampled from the teacher, and no teacher was given (or "
    "the report names none); give teacher=... (the dense model), or train on a text of your own."
)

_LOCAL_NEEDS_TEACHER = (
    "mode='local' trains each changed span towards the teacher's states, and no teacher was given (or the report "
    "names none); give teacher=... (the dense model), or pick mode 'changed', 'last_k', 'full' or 'lora'."
)


def _declines_teacher(teacher: Any) -> bool:
    """Whether the caller asked for no teacher (``teacher=False``, or ``"none"`` from the command line)."""
    return teacher is False or (isinstance(teacher, str) and teacher.lower() == "none")


def _has_teacher(teacher: Any, report: Mapping[str, Any] | None) -> bool:
    """Whether `_resolve_teacher` will load a teacher (nothing is loaded here): what the default mode depends on."""
    if _declines_teacher(teacher):
        return False
    return teacher is not None or default_teacher(report) is not None


def _resolve_teacher(
    teacher: Any, report: Mapping[str, Any] | None, dtype: torch.dtype
) -> tuple[nn.Module | None, Any | None, str | None]:
    """(teacher model, its tokenizer, its public name), or Nones for the LM loss alone."""
    from ..utils.launch import is_writer

    if _declines_teacher(teacher):
        return None, None, None
    if teacher is None:
        teacher = default_teacher(report)
        if teacher is None:
            return None, None, None
        if is_writer():
            logger.info("teacher: %s (the report's base model)", teacher)
    return load_teacher(teacher, dtype)


def checked_teacher(
    student: nn.Module,
    tokenizer: Any,
    teacher: Any,
    report: Mapping[str, Any] | None,
    config: Any,
    texts: list[str],
    samples_text: bool,
) -> tuple[nn.Module | None, str | None, list[str]]:
    """The healing's teacher step: (teacher model or None, its public name, notes for the log), loaded in the
    student's dtype once every check that needs no teacher has passed.

    Refuses no teacher where mode 'local', teacher text (`samples_text`) or hidden-state terms need one, and a
    teacher whose vocabulary or tokenizer differs from the student's; a teacher other than the model compressed is
    allowed, with a warning and a note.
    """
    dtype = next(student.parameters()).dtype
    model, teacher_tokenizer, name = _resolve_teacher(teacher, report, dtype)
    if config.mode == "local" and model is None:
        raise ValueError(_LOCAL_NEEDS_TEACHER)
    if samples_text and model is None:
        raise ValueError(_TEXT_NEEDS_TEACHER)
    if config.hidden_weight > 0 and model is None:
        raise ValueError(
            "hidden-state terms (hidden_weight > 0) need a teacher; give teacher=..., or set hidden_weight to 0."
        )
    if model is None and (config.kd_alpha not in (0.0, 1.0) or config.temperature != 1.0):
        raise ValueError(
            f"kd_alpha={config.kd_alpha} and temperature={config.temperature} weigh and soften the distillation "
            "loss, and there is no teacher (the LM loss alone trains); give teacher=..., or leave them unset."
        )
    notes: list[str] = []
    if model is not None:
        check_compatible(student, model, tokenizer, teacher_tokenizer, texts)
        check_teacher_depth(student, model, report, config)
        mismatch = check_source(model, report, stacklevel=4)  # the warning names recover's caller
        notes += [mismatch] if mismatch else []
    return model, name, notes
