"""Evaluation: perplexity with an explicit protocol, fidelity to the dense model, and inference speed."""

from .fidelity import FidelityResult, fidelity
from .perplexity import PerplexityResult, perplexity, tokenize_corpus
from .speed import decode_tokens_per_second, prefill_tokens_per_second

__all__ = [
    "FidelityResult",
    "PerplexityResult",
    "decode_tokens_per_second",
    "fidelity",
    "perplexity",
    "prefill_tokens_per_second",
    "tokenize_corpus",
]
