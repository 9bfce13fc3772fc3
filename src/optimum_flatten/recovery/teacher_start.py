"""Where each row of the teacher's text starts (`recovery.teacher_text`): the BOS token (EOS where there is none), an
instruct model's chat turn, the first tokens of a prompt document, or a drawn word (`recovery.random_start`); and the
check, shared by the healing's preflight and the sampling, that a row leaves tokens to sample after its start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..utils.errors import CalibrationDataError
from .random_start import OPENING_TOKENS
from .seeded import seeded_split


def start_token(tokenizer: Any) -> tuple[int, str]:
    """(token id, ``"bos"`` or ``"eos"``) every row starts with: the BOS token, else EOS as a document separator."""
    for kind in ("bos", "eos"):
        token = getattr(tokenizer, f"{kind}_token_id", None)
        if token is not None:
            return int(token), kind
    raise CalibrationDataError(
        "sampling the teacher's text needs a start token, and the tokenizer has neither a BOS nor an EOS token; "
        "give prompts=... (documents whose first tokens start the rows)."
    )


#: What stands for the prompt while the chat template is rendered: private-use characters no template writes.
_PROMPT_MARK = "\ue000prompt\ue000"


def row_start(tokenizer: Any, start: str) -> tuple[list[int], list[int], str]:
    """(tokens before each row's prompt, tokens after it, the start's name). ``"bos"``: the start token, nothing
    after. ``"chat"``: the tokenizer's chat template around a user turn holding the prompt, its generation prompt
    opening the assistant's turn, so that an instruct model writes as it was tuned to (with its default system
    turn, if the template has one)."""
    if start == "random":  # the start token; `sample_teacher_rows` draws each row's word and greedy words
        return [start_token(tokenizer)[0]], [], "random"
    if start != "chat":
        token, kind = start_token(tokenizer)
        return [token], [], kind
    if not getattr(tokenizer, "chat_template", None):
        raise CalibrationDataError(
            "sampling_start='chat' needs a tokenizer with a chat template, and this one has none; use 'bos'."
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PROMPT_MARK}], add_generation_prompt=True, tokenize=False
    )
    if not isinstance(text, str) or text.count(_PROMPT_MARK) != 1:
        raise CalibrationDataError("the tokenizer's chat template does not write the user's message once; use 'bos'.")
    before, after = text.split(_PROMPT_MARK)

    def encode(part: str) -> list[int]:
        return list(tokenizer(part, add_special_tokens=False)["input_ids"]) if part else []

    return encode(before), encode(after), "chat"


def checked_start(
    tokenizer: Any, start: str, seqlen: int, prompt_tokens: int, prompted: bool
) -> tuple[list[int], list[int], str, int]:
    """`row_start` and the tokens each row holds before the teacher samples (the start's and the prompt's), refusing
    rows with no token left to sample (one line). The healing's preflight and the sampling both ask this."""
    if start == "random" and prompted:
        raise ValueError(
            "sampling_start='random' draws each row's first token itself and takes no prompts; start prompts "
            "with 'bos' or 'chat'."
        )
    before, after, kind = row_start(tokenizer, start)
    length = len(before) + len(after) + (prompt_tokens if prompted else 0) + (OPENING_TOKENS if kind == "random" else 0)
    if seqlen <= length:
        raise ValueError(
            f"seqlen={seqlen} leaves no token to sample after the {length}-token start and prompt; "
            "raise seqlen or shorten the prompt."
        )
    return before, after, kind, length


def prompt_ids(tokenizer: Any, prompts: Any, prompt_tokens: int, text_column: str = "text") -> list[list[int]]:
    """The first `prompt_tokens` tokens of each prompt document long enough to hold them.

    `prompts` is a list of texts, or a file / any source `calibration.data.load_texts` reads; a ``.txt`` file is one
    prompt a line (not one text, as calibration reads it), since a prompt list is written that way."""
    return [ids for _, ids in _usable_prompts(tokenizer, prompts, prompt_tokens, text_column)]


def prompt_texts(prompts: Any, text_column: str) -> list[str]:
    """The prompt documents: a ``.txt`` file one a line, a table's `text_column` (the healing text's column), or any
    other source `calibration.data.load_texts` reads."""
    from ..calibration.data import load_texts, require_existing

    if isinstance(prompts, (str, os.PathLike)):
        require_existing(prompts, "prompts (--prompts)")
    if isinstance(prompts, (str, os.PathLike)) and Path(prompts).is_file() and Path(prompts).suffix.lower() == ".txt":
        return [line for line in Path(prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
    return load_texts(prompts, text_column)


def _usable_prompts(tokenizer: Any, prompts: Any, prompt_tokens: int, text_column: str) -> list[tuple[str, list[int]]]:
    """(text, its first `prompt_tokens` tokens) of each prompt document long enough to hold them; refuses none."""
    from ..calibration.tokens import tokenize_texts

    texts = prompt_texts(prompts, text_column)
    usable = [
        (text, tokens[:prompt_tokens])
        for text, tokens in zip(texts, tokenize_texts(tokenizer, texts), strict=True)
        if len(tokens) >= prompt_tokens
    ]
    if not usable:
        raise CalibrationDataError(
            f"no prompt holds {prompt_tokens} tokens (of {len(texts)} given); give longer prompts or lower "
            "teacher_prompt_tokens."
        )
    return usable


def split_prompts(
    tokenizer: Any, prompts: Any, prompt_tokens: int, heldout_rows: int, seed: int
) -> tuple[list[str], list[str]]:
    """(the training rows' prompts, the held-out rows'): a seeded choice of up to `heldout_rows` prompts, at most half
    of them, that only held-out rows continue. A prompt's tokens are trained on as part of its rows, so a held-out row
    continuing a training row's prompt would be partly trained text; with a single prompt both parts take it (and
    `mask_opening` keeps the gate off its tokens)."""
    texts = [text for text, _ in _usable_prompts(tokenizer, prompts, prompt_tokens, "text")]
    held = min(heldout_rows, len(texts) // 2)
    if held == 0:
        return texts, texts
    return seeded_split(texts, held, seed + 4)


def mask_opening(rows: list[dict[str, torch.Tensor]], opening: int) -> None:
    """Leaves each row's first `opening` tokens (its start and prompt, which the teacher did not write) out of the
    losses (labels -100), in place: what the gate's held-out rows score is then only what the teacher sampled."""
    for row in rows:
        row["labels"][:opening] = -100
