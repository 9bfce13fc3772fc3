"""Perplexity of a causal LM on a token stream, with every protocol detail recorded next to the number."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..calibration.tokens import token_stream
from ..utils.torch_utils import input_device


@dataclass
class PerplexityResult:
    """Perplexity and the protocol that produced it.

    Attributes:
        perplexity: exp(mean NLL over scored tokens).
        nll: mean negative log-likelihood in nats.
        scored_tokens: tokens whose prediction was scored.
        seqlen: window length fed to the model.
        stride: step between windows over the stream (with a BOS at most seqlen - 1); with stride < seqlen only
            the last `stride` tokens of a window are scored (the first window scores all but its first token).
        windows: number of windows.
        bos: whether a BOS token was prepended to every window.
    """

    perplexity: float
    nll: float
    scored_tokens: int
    seqlen: int
    stride: int
    windows: int
    bos: bool

    def protocol(self) -> str:
        return (
            f"{self.scored_tokens} scored tokens, {self.windows} windows of {self.seqlen}, stride {self.stride}, "
            f"BOS {'prepended' if self.bos else 'not prepended'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "protocol": self.protocol()}


def tokenize_corpus(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """One token stream: the texts tokenised without special tokens, separated by EOS when the tokenizer has one
    (`calibration.tokens.token_stream`'s int64 tensor, 8 bytes a token, never a list of Python ints)."""
    return token_stream(tokenizer, texts)


#: The largest x whose exp(x) a float holds (math.exp raises OverflowError past it).
_LARGEST_EXPONENT = math.log(sys.float_info.max)


def scored_stream(tokens: torch.Tensor, max_tokens: int | None) -> torch.Tensor:
    """The first `max_tokens` tokens of the stream (all with None), refusing a budget that scores nothing: a token is
    scored from the one before it, so fewer than 2 leave no prediction (a negative count would slice from the end)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (a token is scored from the one before it), got {max_tokens}.")
    if tokens.dim() == 2 and tokens.shape[0] == 1:  # a tokenizer's return_tensors="pt" ids: one row, the stream
        tokens = tokens[0]
    if tokens.dim() != 1:
        raise ValueError(f"the token stream must be 1-D (or one row), got shape {tuple(tokens.shape)}.")
    return tokens if max_tokens is None else tokens[:max_tokens]


def window_step(seqlen: int, stride: int, bos: bool) -> int:
    """How far the windows advance over the stream: `stride`, but at most the stream tokens a window holds (seqlen
    - 1 with a BOS), so that no token goes unscored; the protocol reports this step, not the stride asked for."""
    if not 0 < stride <= seqlen:
        raise ValueError(f"stride must be in 1..seqlen={seqlen}, got {stride}.")
    body = seqlen - (1 if bos else 0)
    if body < 1:
        raise ValueError(f"seqlen={seqlen} leaves no room for stream tokens.")
    return min(stride, body)


def evaluation_windows(num_tokens: int, seqlen: int, stride: int, bos: bool) -> list[tuple[int, int, int]]:
    """The windows of the evaluation protocol, as (start, end, first scored offset) over the stream.

    Shared by `perplexity` and `fidelity.fidelity`, so that a KL or an agreement is measured on exactly the tokens a
    perplexity beside it was. No token is scored twice; without a BOS a window's first token is only scored when an
    earlier window gave it context (stride < seqlen). With a BOS, windows hold seqlen - 1 stream tokens.
    """
    prefix = 1 if bos else 0
    body = seqlen - prefix
    step = window_step(seqlen, stride, bos)
    windows: list[tuple[int, int, int]] = []
    previous_end = 0
    for start in range(0, num_tokens, step):
        end = min(start + body, num_tokens)
        first = max(previous_end - start, 0 if prefix else 1)
        windows.append((start, end, first))
        previous_end = end
        if end == num_tokens:
            break
    return windows


def window_batches(
    stream: torch.Tensor, windows: Sequence[tuple[int, int, int]], batch_size: int, bos_token_id: int | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, score) per batch of windows, on the CPU, right-padded to the longest window.

    `score[r, t]` is True where token t of row r is scored, i.e. where the logits at t - 1 are evaluated.
    """
    prefix = 1 if bos_token_id is not None else 0
    for b in range(0, len(windows), batch_size):
        chunk = windows[b : b + batch_size]
        width = max(e - s for s, e, _ in chunk)
        ids = torch.zeros(len(chunk), width + prefix, dtype=torch.long)
        mask = torch.zeros_like(ids)
        score = torch.zeros_like(ids, dtype=torch.bool)
        for r, (s, e, first) in enumerate(chunk):
            if prefix:
                ids[r, 0] = bos_token_id
            ids[r, prefix : prefix + e - s] = stream[s:e]
            mask[r, : prefix + e - s] = 1
            score[r, prefix + first : prefix + e - s] = True
        yield ids, mask, score


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokens: torch.Tensor,
    seqlen: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4,
    bos_token_id: int | None = None,
) -> PerplexityResult:
    """Perplexity over `tokens` with windows of `seqlen` tokens advancing by `stride` (default: seqlen).

    Args:
        model: a causal LM returning `.logits`.
        tokens: 1-D token stream (see `tokenize_corpus`).
        seqlen: window length.
        stride: window step; no token is scored twice, and a window re-reads seqlen - stride tokens of the
            previous one as context.
        max_tokens: only the first `max_tokens` tokens of the stream are used (None: all).
        batch_size: windows per forward.
        bos_token_id: prepended to every window when given (then windows hold seqlen - 1 stream tokens).
    """
    stride = seqlen if stride is None else stride
    stream = scored_stream(tokens, max_tokens)
    windows = evaluation_windows(stream.numel(), seqlen, stride, bos=bos_token_id is not None)
    device = input_device(model)
    was_training = model.training
    model.eval()
    total_nll, total_count = 0.0, 0
    for ids, mask, score in window_batches(stream, windows, batch_size, bos_token_id):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        targets = ids[:, 1:].to(device)
        selected = score[:, 1:].to(device)
        for row in range(logits.shape[0]):  # one row at a time: a (seq, vocab) float32 copy, not (batch, seq, vocab)
            keep = selected[row]
            row_logits = logits[row, :-1][keep].float()
            nll = torch.nn.functional.cross_entropy(row_logits, targets[row][keep], reduction="sum")
            total_nll += float(nll.double())
            total_count += int(keep.sum())
    model.train(was_training)
    if total_count == 0:
        raise ValueError(f"no token was scored: the stream holds {stream.numel()} tokens; give a longer text.")
    mean = total_nll / total_count
    return PerplexityResult(
        perplexity=math.exp(mean) if mean < _LARGEST_EXPONENT else math.inf,  # a broken model: past a float's range
        nll=mean,
        scored_tokens=total_count,
        seqlen=seqlen,
        stride=window_step(seqlen, stride, bos_token_id is not None),
        windows=len(windows),
        bos=bos_token_id is not None,
    )
