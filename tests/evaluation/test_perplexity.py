import math

import pytest
import torch

import tiny_models
from optimum_flatten.evaluation import perplexity, tokenize_corpus


def _naive_nll_sum(model, window, first_scored):
    """Sum of -log p(token_t | tokens_<t) for t >= first_scored, one window at a time, float64 softmax."""
    with torch.no_grad():
        logits = model(input_ids=window[None]).logits[0].double()
    total = 0.0
    for t in range(max(first_scored, 1), window.numel()):
        total -= torch.log_softmax(logits[t - 1], dim=-1)[window[t]].item()
    return total, window.numel() - max(first_scored, 1)


@pytest.mark.parametrize(("seqlen", "stride"), [(16, 16), (16, 8), (10, 3)])
def test_perplexity_equals_naive_reference(seqlen, stride):
    model = tiny_models.tiny_llama_gqa()
    stream = torch.randint(3, tiny_models.VOCAB, (57,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, stream, seqlen=seqlen, stride=stride, batch_size=3)
    total, count, previous_end, start = 0.0, 0, 0, 0
    while True:
        end = min(start + seqlen, stream.numel())
        nll, n = _naive_nll_sum(model, stream[start:end], previous_end - start)
        total, count, previous_end = total + nll, count + n, end
        if end == stream.numel():
            break
        start += stride
    assert result.scored_tokens == count
    assert math.isclose(result.perplexity, math.exp(total / count), rel_tol=1e-5)
    if stride < seqlen:
        assert count == stream.numel() - 1  # every token but the first is scored exactly once


def test_bos_prefix_scores_every_window_token():
    model = tiny_models.tiny_llama_gqa()
    stream = torch.randint(3, tiny_models.VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    result = perplexity(model, stream, seqlen=11, bos_token_id=1)
    assert result.bos and result.scored_tokens == 30 and result.windows == 3
    total = 0.0
    for start in range(0, 30, 10):
        window = torch.cat([torch.tensor([1]), stream[start : start + 10]])
        nll, _ = _naive_nll_sum(model, window, 1)
        total += nll
    assert math.isclose(result.perplexity, math.exp(total / 30), rel_tol=1e-5)
    assert "30 scored tokens, 3 windows of 11, stride 10, BOS prepended" == result.protocol()  # 10 stream tokens each


def test_tokenize_corpus_separates_texts_with_eos():
    stream = tokenize_corpus(tiny_models.CharTokenizer(), ["ab", "c"])
    assert stream.tolist() == [3 + ord("a") % 93, 3 + ord("b") % 93, 2, 3 + ord("c") % 93, 2]
