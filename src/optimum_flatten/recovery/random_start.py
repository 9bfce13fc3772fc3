"""Rows that open on the whole vocabulary: LLM-QAT's start for data-free distillation (Liu et al. 2023, arXiv
2305.17888, §2.1), ``RecoveryConfig.sampling_start="random"``.

From a bare start token a model writes from the few openings it favours: SmolLM2-Instruct tells stories,
Qwen2.5-Coder-Instruct writes code and Chinese (benchmarks/NOTEBOOK.md). LLM-QAT draws each sequence's first token
uniformly from the vocabulary, so that the generated set spreads over what the model knows, takes the model's top-1
next token for the following few (3 to 5), and samples the rest; the paper reports this mix above sampling or greedy
decoding throughout. A few greedy words give the row a coherent opening after a random word, which the sampling then
continues (on SmolLM2, sampling straight after the drawn word wrote fragments of URLs and code). Here the rows are
the start token, the drawn word, `GREEDY_TOKENS` greedy tokens, then the same plain sampling as every other start
(`recovery.teacher_text`).

The draws of all rows come from one seeded stream and are dealt to the ranks as the rows are, so the rows do not
depend on how many processes sample them; the greedy words are deterministic.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ..utils.errors import CalibrationDataError

#: The teacher's top-1 tokens after the drawn one (LLM-QAT: "3 to 5"; the middle).
GREEDY_TOKENS = 4
#: Tokens a random start adds after the start token: the drawn one and the greedy ones (none sampled).
OPENING_TOKENS = 1 + GREEDY_TOKENS
#: The sampling's settings a greedy step has no use for (transformers warns where they are given).
_SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def first_tokens(tokenizer: Any, vocab_size: int) -> list[int]:
    """The ids a row may open with: every id below `vocab_size` (the model's embedding rows) and the tokenizer's
    length but its special and added tokens (BOS, EOS, padding, chat markers), which the model reads as a document's
    or a turn's boundary rather than as a word."""
    size = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
    special |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", None) or {}}
    special |= {getattr(tokenizer, f"{kind}_token_id", None) for kind in ("bos", "eos", "pad", "unk")}
    ids = [i for i in range(size) if i not in special]
    if not ids:
        raise CalibrationDataError("the tokenizer has no ordinary token to open a row with; use sampling_start='bos'.")
    return ids


def drawn_tokens(candidates: list[int], n_rows: int, rows: tuple[int, int], seed: int) -> list[int]:
    """The first tokens of rows ``rows = (first, count)`` of `n_rows`: all `n_rows` drawn uniformly, with
    replacement, from one stream seeded by `seed`, then sliced, so a rank's rows are those of a single process."""
    first, count = rows
    return random.Random(seed).choices(candidates, k=n_rows)[first : first + count]


def drawn_starts(
    before: list[int], candidates: list[int], n_rows: int, rows: tuple[int, int], seed: int
) -> torch.Tensor:
    """This rank's rows' beginnings before the greedy words: ``before`` (the start token) and a drawn token each, a
    ``(count, len(before) + 1)`` tensor (`drawn_tokens`)."""
    drawn = drawn_tokens(candidates, n_rows, rows, seed)
    return torch.tensor([[*before, token] for token in drawn], dtype=torch.long).view(len(drawn), len(before) + 1)


def greedy_kwargs(generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``generate`` is given for the greedy words: the sampling's own settings (`teacher_text.sampling_kwargs`:
    no penalty, EOS an ordinary token, whatever the model's generation_config.json says) without the sampling and
    its cuts, for `GREEDY_TOKENS` new tokens."""
    greedy = {key: value for key, value in generate_kwargs.items() if key not in _SAMPLING_ONLY}
    return {**greedy, "do_sample": False, "min_new_tokens": GREEDY_TOKENS, "max_new_tokens": GREEDY_TOKENS}
