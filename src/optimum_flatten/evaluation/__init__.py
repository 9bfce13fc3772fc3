"""Evaluation: perplexity with an explicit protocol, and inference speed."""

from .perplexity import PerplexityResult, perplexity, tokenize_corpus
from .speed import decode_tokens_per_second, prefill_tokens_per_second

__all__ = [
    "PerplexityResult",
    "decode_tokens_per_second",
    "perplexity",
    "prefill_tokens_per_second",
    "tokenize_corpus",
]
