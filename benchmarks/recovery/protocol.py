"""The healing benchmark's default protocol, defined once for the run script (`run.py`), the pages (`render.py`)
and the curves (`curve.py`): a run that departs from it writes a file of its own and is shown apart.

- Evaluation tokens per text, by model: what each model's depth table scores (16K for SmolLM2-135M, 8K for the
  larger models, whose evaluation costs more on a CPU).
- Training rows: 256 tokens, 4 rows an optimiser step (`RecoveryConfig`'s defaults; rows of 512 × 2 were measured
  level with them within the spread of two healing seeds, benchmarks/NOTEBOOK.md).
- The token embeddings and the LM head trained with the rest (`RecoveryConfig.train_embeddings`'s default); a run
  with them frozen (`--freeze-embeddings`) is a line of its own.
- The healing text: the pre-2000 speeches outside the calibration windows. A run on the dense model's own text
  (`--teacher-text 1.0`) or a mix (`--teacher-text 0.5`) is a line of its own, and so is a run with another
  optimiser than the Trainer's AdamW (`--optim`). A run on the dense model's text whose gate is guarded by held-out
  speeches (`--guard-speeches`) is one too.
- The compression calibrated on the speeches (`CALIBRATION` of run.py); one calibrated on a mix
  (`--calibration sotu+teacher`) starts from another model and is a line of its own.
- The healing seed 0: it draws the gate's held-out rows and orders the training rows. A run with another seed measures
  the spread between runs; its gate held out other rows, so its objective ranks nothing beside seed 0's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVAL_TOKENS = {"smollm2": 16384, "qwen2.5-0.5b": 8192, "gemma3-270m": 8192}
TRAINING_ROWS = {"seqlen": 256, "batch_size": 4}
SEED = 0


def training_rows(settings: Mapping[str, Any]) -> dict[str, int]:
    """A run's training rows (length and rows a step) from its recorded settings; runs from before the options
    had the default's."""
    return {key: int(settings.get(key, default)) for key, default in TRAINING_ROWS.items()}


def seed(settings: Mapping[str, Any]) -> int:
    """A run's healing seed from its recorded settings (runs from before the option had 0)."""
    return int(settings.get("seed", SEED))


def frozen_embeddings(settings: Mapping[str, Any]) -> bool:
    """Whether a run kept the token embeddings and the LM head frozen (runs from before the option trained them)."""
    return bool(settings.get("freeze_embeddings", False))


def default_loss(settings: Mapping[str, Any]) -> bool:
    """Whether a run's loss is the default's: no hidden-state terms, the teacher at temperature 1, the KL alone
    (runs from before the options had none)."""
    return (
        not settings.get("hidden_weight")
        and float(settings.get("temperature", 1.0)) == 1.0
        and float(settings.get("kd_alpha", 1.0)) == 1.0
    )


def calibration(settings: Mapping[str, Any]) -> str:
    """The compression's calibration text, ``""`` for the speeches (runs from before the option had them)."""
    choice = str(settings.get("calibration") or "sotu")
    seed = int(settings.get("calibration_seed") or 0)
    own = float(settings.get("own_text") or 0.0)
    if own:  # the product's option: the speeches' windows and the dense model's own rows
        return ("" if choice == "sotu" else choice + ", ") + f"own_text={own:g}" + (f" (seed {seed})" if seed else "")
    return "" if choice == "sotu" else choice + (f" (its rows' seed {seed})" if seed else "")


def is_default(settings: Mapping[str, Any]) -> bool:
    """Whether a run trained on the default rows with the default seed, embeddings included, on the speeches with
    AdamW and the default loss: the runs the product table and the curves rank and draw together (a gate's held-out
    objective ranks runs only on the same held-out text)."""
    return (
        default_loss(settings)
        and training_rows(settings) == TRAINING_ROWS
        and seed(settings) == SEED
        and not frozen_embeddings(settings)
        and not healing_text(settings)
        and not optimiser(settings)
        and not calibration(settings)
    )


def healing_text(settings: Mapping[str, Any]) -> str:
    """What a run healed on, as the pages and curves name it: ``""`` for the speeches (the default), else the share
    of the rows the dense model sampled itself and what it started from (runs from before the options healed on the
    speeches, and sampled from the BOS token)."""
    share = float(settings.get("teacher_text") or 0.0)
    if share <= 0:
        return ""
    own = "the dense model's own text"
    if settings.get("sampling_start") == "chat":
        own += " as a chat assistant"
    if settings.get("sampling_start") == "random":
        own += " from a random first token"
    if settings.get("teacher_prompts"):
        own += " continuing the speeches' paragraphs"
    if (temperature := float(settings.get("sampling_temperature") or 1.0)) != 1.0:
        own += f" sampled at temperature {temperature:g}"
    if settings.get("teacher_text_loops") == "mask":
        own += ", its repeats left out of the loss"
    if settings.get("guard_speeches"):
        own += ", guarded by held-out speeches"
    return own if share >= 1 else f"{share:.0%} {own}, the rest speeches"


def optimiser(settings: Mapping[str, Any]) -> str:
    """The Trainer optimiser a run asked for, ``""`` for the default AdamW (runs from before the option had it)."""
    return str(settings.get("optim") or "")
