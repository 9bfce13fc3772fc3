"""Comparing models whose tokenizers differ: is the text tokenised alike, and bits per byte when it is not.

A perplexity is a mean loss per token. Two models that cut the same text into different tokens are scored on
different units (and, with a token budget, on different amounts of text), so the ratio of their perplexities
compares nothing; neither do per-token KL or top-1 agreement, whose positions do not line up. What stays comparable
is the loss of the whole text per byte of it: bits per byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .perplexity import tokenize_corpus


@dataclass
class TokenizationDifference:
    """Where two tokenizers first part ways on the evaluation stream (both streams as `tokenize_corpus` makes them).

    Attributes:
        position: Index of the first token that differs (or the length of the shorter stream).
        baseline: The baseline's token there, as text (None past the end of its stream).
        model: The model's token there, as text (None past the end of its stream).
        baseline_id: The baseline's token id there (None past the end of its stream).
        model_id: The model's token id there (None past the end of its stream).
    """

    position: int
    baseline: str | None
    model: str | None
    baseline_id: int | None = None
    model_id: int | None = None

    def describe(self) -> str:
        """Where the streams part, each side's token with its id: two vocabularies often spell the same piece
        with other ids, and the pieces alone would read as the same token twice."""
        return (
            f"token {self.position} is {_spelled(self.baseline, self.baseline_id)} for the baseline and "
            f"{_spelled(self.model, self.model_id)} for the model"
        )


def _spelled(token: str | None, token_id: int | None) -> str:
    return "the end of its stream" if token is None else f"{token!r} (id {token_id})"


def first_difference(
    baseline_tokenizer: Any, model_tokenizer: Any, texts: Sequence[str], max_tokens: int | None
) -> TokenizationDifference | None:
    """None when both tokenizers encode the first `max_tokens` tokens of the evaluation stream identically (the
    stream perplexity and fidelity score), else where they first differ."""
    a = tokenize_corpus(baseline_tokenizer, texts)
    b = tokenize_corpus(model_tokenizer, texts)
    if max_tokens is not None:
        a, b = a[:max_tokens], b[:max_tokens]
    n = min(a.numel(), b.numel())
    unequal = torch.nonzero(a[:n] != b[:n]).flatten()
    if unequal.numel() == 0 and a.numel() == b.numel():
        return None
    position = int(unequal[0]) if unequal.numel() else n
    return TokenizationDifference(
        position,
        _token_text(baseline_tokenizer, a, position),
        _token_text(model_tokenizer, b, position),
        int(a[position]) if position < a.numel() else None,
        int(b[position]) if position < b.numel() else None,
    )


def _token_text(tokenizer: Any, stream: torch.Tensor, position: int) -> str | None:
    if position >= stream.numel():
        return None
    return str(tokenizer.convert_ids_to_tokens(int(stream[position])))


def text_budget(tokenizer: Any, texts: Sequence[str], max_tokens: int | None) -> list[str]:
    """The evaluation text the baseline's first `max_tokens` tokens cover, as texts (the last one cut): every model
    is then scored on this same text, whatever its tokenizer, so bits per byte compare like with like."""
    if max_tokens is None:
        return list(texts)
    kept: list[str] = []
    used = 0
    eos = getattr(tokenizer, "eos_token_id", None)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        room = max_tokens - used
        if len(ids) + (eos is not None) <= room:
            kept.append(text)
            used += len(ids) + (eos is not None)
            continue
        room -= 1 if eos is not None else 0  # `tokenize_corpus` ends every text, the cut one too, with EOS
        if room > 0:
            kept.append(_covered(tokenizer, text, ids, room))
        break
    return kept


def _covered(tokenizer: Any, text: str, ids: list[int], room: int) -> str:
    """The start of `text` that its first `room` tokens cover, cut from the text itself at the tokenizer's character
    offsets. Decoding the tokens instead need not give the text back (a word-level tokenizer joins its tokens with
    spaces, a normaliser changes the case), and both models would then be scored on a text neither was given. A
    tokenizer without offsets (a slow one) is decoded, and refused where that is not the text's start."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text[: offsets[room - 1][1]]
    decoded = tokenizer.decode(ids[:room], clean_up_tokenization_spaces=False)
    if not text.startswith(decoded):
        raise ValueError(
            f"cannot cut the evaluation text at the baseline's first {room} tokens: its tokenizer gives no character "
            "offsets and does not decode back to the text; score the whole text (max_tokens=None, --max-tokens none) "
            "or use the fast version of the tokenizer."
        )
    return decoded


def bits_per_byte(mean_nll: float, tokens: int, texts: Sequence[str]) -> float:
    """Bits per UTF-8 byte of `texts` for a model whose mean loss per scored token is `mean_nll` (nats) over a
    stream of `tokens` tokens of those texts: mean_nll / ln 2 x tokens / bytes.

    The first token of each evaluation window is not scored (nothing precedes it), so the total loss is estimated
    as the mean over scored tokens times all tokens: a bias of about one token in a window (0.2% at 512).
    """
    size = sum(len(text.encode("utf-8")) for text in texts)
    if size == 0:
        raise ValueError("the evaluation text is empty: bits per byte are undefined.")
    return mean_nll / math.log(2) * tokens / size
