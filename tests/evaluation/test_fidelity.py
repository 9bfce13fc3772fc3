import copy
import itertools
import math

import pytest
import torch

import tiny_models
from optimum_flatten.evaluation import fidelity, perplexity
from optimum_flatten.evaluation.perplexity import evaluation_windows


def _naive(dense, compressed, stream, seqlen, stride, bos_token_id=None):
    """Full-vocabulary reference, one window at a time, float64: (mean KL, agreement, dense NLL, compressed NLL, n)."""
    prefix = [bos_token_id] if bos_token_id is not None else []
    kl = agree = nll_d = nll_c = 0.0
    count = 0
    for start, end, first in evaluation_windows(stream.numel(), seqlen, stride, bos=bool(prefix)):
        window = torch.tensor(prefix + stream[start:end].tolist())[None]
        with torch.no_grad():
            logits_d = dense(input_ids=window).logits[0].double()
            logits_c = compressed(input_ids=window).logits[0].double()
        for t in range(len(prefix) + first, window.shape[1]):  # token t is scored from the logits at t - 1
            log_p = torch.log_softmax(logits_d[t - 1], dim=-1)
            log_q = torch.log_softmax(logits_c[t - 1], dim=-1)
            kl += float((log_p.exp() * (log_p - log_q)).sum())
            agree += float(logits_d[t - 1].argmax() == logits_c[t - 1].argmax())
            nll_d -= float(log_p[window[0, t]])
            nll_c -= float(log_q[window[0, t]])
            count += 1
    return kl / count, agree / count, nll_d / count, nll_c / count, count


def _stream(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, tiny_models.VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("seqlen", "stride", "chunk_size", "bos"),
    [(16, 16, 7, None), (16, 8, 5, None), (12, 5, 64, None), (11, 11, 3, 1)],
)
def test_fidelity_equals_naive_full_vocabulary_reference(seqlen, stride, chunk_size, bos):
    # Chunk sizes 7, 5 and 3 divide neither a window nor a batch of scored positions.
    dense, compressed = tiny_models.tiny_llama_gqa(seed=0), tiny_models.tiny_llama_gqa(seed=3)
    stream = _stream(61, seed=1)
    result = fidelity(
        dense, compressed, stream, seqlen=seqlen, stride=stride, batch_size=3, bos_token_id=bos, chunk_size=chunk_size
    )
    kl, agreement, nll_d, nll_c, count = _naive(dense, compressed, stream, seqlen, stride, bos)
    assert result.scored_tokens == count
    assert result.kl > 0.01  # two different random models: the comparison is not trivially zero
    assert math.isclose(result.kl, kl, rel_tol=1e-5)
    assert result.top1_agreement == pytest.approx(agreement, abs=1e-12)
    assert math.isclose(result.dense_nll, nll_d, rel_tol=1e-6)
    assert math.isclose(result.compressed_nll, nll_c, rel_tol=1e-6)
    # The same windows and scored tokens as the perplexity beside it.
    ppl = perplexity(compressed, stream, seqlen=seqlen, stride=stride, batch_size=2, bos_token_id=bos)
    assert (ppl.scored_tokens, ppl.windows) == (result.scored_tokens, result.windows)
    assert math.isclose(result.compressed_perplexity, ppl.perplexity, rel_tol=1e-6)
    assert result.protocol() == ppl.protocol()
    # The step the windows took over the stream: a BOS window of 11 holds 10 stream tokens, so stride 11 steps by 10.
    starts = [start for start, _, _ in evaluation_windows(stream.numel(), seqlen, stride, bos=bos is not None)]
    assert {b - a for a, b in itertools.pairwise(starts)} == {result.stride} == {ppl.stride}


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fidelity_against_a_shallower_model_and_the_token_cap():
    """The real use: a model with layers removed (same vocabulary), on the first max_tokens tokens only."""
    dense = tiny_models.tiny_llama_gqa()
    compressed = copy.deepcopy(dense)
    del compressed.model.layers[2:4]
    compressed.config.num_hidden_layers = 4
    for index, layer in enumerate(compressed.model.layers):
        layer.self_attn.layer_idx = index
    stream = _stream(80, seed=2)
    calls = _count_forwards(compressed)
    result = fidelity(dense, compressed, stream, seqlen=16, max_tokens=50, chunk_size=9, batch_size=2)
    assert calls[0] == 2  # one forward per batch of windows: the head-split path, no full-logits fallback
    kl, agreement, _, _, count = _naive(dense, compressed, stream[:50], 16, 16)
    assert result.scored_tokens == count == 50 - 4  # 4 windows, the first token of each is not scored
    # A small KL (about 1e-3 here) is a sum of float32 differences of log-probabilities of about 4.6: an absolute
    # round-off of a few 1e-8 on top of the relative one.
    assert math.isclose(result.kl, kl, rel_tol=1e-5, abs_tol=1e-7)
    assert result.top1_agreement == pytest.approx(agreement)


def test_identical_models_have_zero_kl_and_full_agreement():
    dense = tiny_models.tiny_qwen2()
    stream = _stream(45, seed=4)
    for other in (dense, copy.deepcopy(dense)):
        result = fidelity(dense, other, stream, seqlen=16, stride=8, chunk_size=10)
        assert result.kl == 0.0
        assert result.top1_agreement == 1.0
        assert result.dense_nll == result.compressed_nll


def test_a_post_head_logit_transform_falls_back_to_full_logits():
    """Gemma-2 soft-caps the logits after the head: head(hidden) alone would be wrong, and is detected."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(
        vocab_size=tiny_models.VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,  # small, so that the cap changes every logit
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(1)
    compressed = AutoModelForCausalLM.from_config(config).eval()
    stream = _stream(40, seed=5)
    calls = _count_forwards(compressed)
    result = fidelity(dense, compressed, stream, seqlen=16, chunk_size=6, batch_size=2)
    assert calls[0] == 3  # 2 batches, plus the first one again once the soft-cap was detected
    kl, agreement, _, _, _ = _naive(dense, compressed, stream, 16, 16)
    assert math.isclose(result.kl, kl, rel_tol=1e-5) and result.top1_agreement == pytest.approx(agreement)


def test_bad_input_is_refused():
    model = tiny_models.tiny_llama_gqa()
    with pytest.raises(ValueError, match="chunk_size"):
        fidelity(model, model, _stream(20, 0), seqlen=8, chunk_size=0)
    with pytest.raises(ValueError, match="stride"):
        fidelity(model, model, _stream(20, 0), seqlen=8, stride=9)
    with pytest.raises(ValueError, match="empty"):
        fidelity(model, model, torch.zeros(0, dtype=torch.long), seqlen=8)
