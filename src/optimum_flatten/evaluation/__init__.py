"""Evaluation: perplexity with an explicit protocol, fidelity to the dense model, and inference speed."""

from .fidelity import FidelityResult, fidelity
from .generation import GenerationAgreement, generation_agreement
from .perplexity import PerplexityResult, perplexity, tokenize_corpus
from .speed import (
    SpeedComparison,
    SpeedVerdict,
    compare_decode,
    compare_prefill,
    decode_tokens_per_second,
    prefill_tokens_per_second,
    speed_verdict,
)

__all__ = [
    "FidelityResult",
    "GenerationAgreement",
    "PerplexityResult",
    "SpeedComparison",
    "SpeedVerdict",
    "compare_decode",
    "compare_prefill",
    "decode_tokens_per_second",
    "fidelity",
    "generation_agreement",
    "perplexity",
    "prefill_tokens_per_second",
    "speed_verdict",
    "tokenize_corpus",
]
