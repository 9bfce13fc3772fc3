"""`text_budget`: the text a baseline's first tokens cover, which every model of a cross-tokenizer evaluation is
scored on, must be the evaluation text itself, cut, whatever the tokenizer's decode gives back."""

from __future__ import annotations

import pytest

import tiny_models
from optimum_flatten.evaluation.tokenization import text_budget


@pytest.mark.parametrize("budget", [7, 50, 333, 1000])
def test_the_budget_is_a_cut_of_the_text_not_its_decoding(budget):
    """The tiny character tokenizer decodes "of nation" as "o f   n a t i o n": a decoded cut would score a
    spaced-out text. The cut is the texts' own start, the last one cut inside, and holds the budget in tokens."""
    tokenizer = tiny_models.tiny_hf_tokenizer()
    texts = tiny_models.sample_texts()
    assert tokenizer.decode(tokenizer("of nation", add_special_tokens=False)["input_ids"]) != "of nation"
    kept = text_budget(tokenizer, texts, budget)
    assert kept[:-1] == texts[: len(kept) - 1] and texts[len(kept) - 1].startswith(kept[-1])
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in kept)  # + EOS each
    assert tokens == budget or (tokens < budget and kept == texts[: len(kept)] and len(kept) == len(texts))
