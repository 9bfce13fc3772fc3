import math
import re

import pytest

import tiny_models
from optimum_flatten.evaluation import perplexity

pytest.importorskip("lm_eval")


def test_local_text_task_matches_our_perplexity_on_the_same_tokens():
    from optimum_flatten.evaluation.harness import local_text_perplexity

    model, tokenizer = tiny_models.tiny_llama_gqa(), tiny_models.tiny_hf_tokenizer()
    texts = ["the state of the union is strong.", "we work for peace and law every year, and we keep it."]
    result = local_text_perplexity(model, tokenizer, texts, batch_size=2, max_length=128)
    # Reference: each document scored whole after a BOS (lm-eval's rolling log-likelihood on documents shorter
    # than the context), summed over documents.
    total_nll = 0.0
    for text in texts:
        tokens = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        ours = perplexity(model, tokens, seqlen=tokens.numel() + 1, bos_token_id=tokenizer.bos_token_id)
        total_nll += ours.nll * ours.scored_tokens
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert math.isclose(result["word_perplexity,none"], math.exp(total_nll / words), rel_tol=1e-4)
    assert math.isclose(result["byte_perplexity,none"], math.exp(total_nll / num_bytes), rel_tol=1e-4)
    assert math.isclose(result["bits_per_byte,none"], total_nll / num_bytes / math.log(2), rel_tol=1e-4)
