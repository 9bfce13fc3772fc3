"""How long a sequence a model can take, checked before any calibration or evaluation runs.

A model with a table of positions (GPT-2's learned ``wpe`` of ``n_positions`` rows, BERT's learned absolute
embeddings, Marian's fixed sinusoidal table) has no embedding for a position past the table: a longer sequence ends
in a bare ``IndexError`` deep inside the forward, after loading and tokenising. A RoPE model computes any position,
but past ``max_position_embeddings`` it runs at lengths it was not trained on, so statistics gathered there may not
describe the model as it is used: that is worth a warning, not a refusal.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import CalibrationDataError

logger = logging.getLogger(__name__)

#: Families whose positions come from a table (learned or fixed sinusoidal) of ``max_position_embeddings`` rows.
TABLE_POSITION_TYPES = frozenset(
    {"gpt2", "bert", "roberta", "distilbert", "marian", "opt", "gpt_neo", "xlm-roberta", "electra", "bart", "mbart"}
)
#: Config keys that only rotary-position models carry.
_ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_emb_base")


def position_limit(config: Any) -> tuple[int, str, bool] | None:
    """(positions, config key, hard) for a model config; None when the model has no limit to check (images, ALiBi).

    ``hard`` is True for a table of positions (a longer sequence cannot run) and False for RoPE (it runs, past the
    trained length). A family this module does not know, without RoPE keys, counts as RoPE: a warning is safer than
    refusing a model that would have worked.
    """
    n_positions = getattr(config, "n_positions", None)
    if isinstance(n_positions, int) and n_positions > 0:
        return n_positions, "n_positions", True
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    settings = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    rope = any(settings.get(key) is not None for key in _ROPE_KEYS)
    hard = not rope and getattr(config, "model_type", None) in TABLE_POSITION_TYPES
    return limit, "max_position_embeddings", hard


def check_sequence_length(model_or_config: Any, seqlen: int, option: str = "seqlen", warn: bool = True) -> None:
    """Refuses a `seqlen` longer than a position table, and warns when it is longer than a RoPE model's training.

    Args:
        model_or_config: A model (its ``config`` is read) or a config.
        seqlen: Tokens per sequence that will be run.
        option: The name of the option to lower, for the message (``"seqlen"``, ``"--seqlen"``).
        warn: Whether to warn for RoPE; False where a later check of the same length warns (a healing's rows are
            checked before the compression, and again by `recover`: one warning, not two).

    Raises:
        CalibrationDataError: for a table of positions shorter than `seqlen`.
    """
    config = getattr(model_or_config, "config", model_or_config)
    limit = position_limit(config)
    if limit is None or seqlen <= limit[0]:
        return
    positions, key, hard = limit
    architecture = (getattr(config, "architectures", None) or [type(model_or_config).__name__])[0]
    if hard:
        raise CalibrationDataError(
            f"{option}={seqlen} is longer than the {positions} positions of this {architecture} (config.{key}): its "
            f"position embeddings are a table with no row past {positions - 1}. Use {option} <= {positions}."
        )
    if warn:
        logger.warning(
            "%s=%d is longer than this %s was trained on (config.%s = %d): rotary positions run past that length, so "
            "the measured statistics may not describe the model in use; %s <= %d is safer.",
            option,
            seqlen,
            architecture,
            key,
            positions,
            option,
            positions,
        )
