"""Fidelity of a compressed model to its dense original: mean per-token KL(dense ‖ compressed) and top-1 agreement.

Perplexity says how well a model predicts the text; fidelity says how much of the dense model's behaviour survived.
Two compressed models with the same perplexity can disagree with the dense one on very different tokens, and a
compressed model can even beat the dense perplexity on a text while drifting away from it. Both numbers are measured
on exactly the windows and scored positions of `perplexity` (same `evaluation_windows`, same masking), so they sit
beside a perplexity ratio without any protocol difference.

Memory. Neither model's full logits are kept (`utils.lm_head.states_and_head`: the LM head's input is recorded and
the head runs on the last position only). The scored positions are then pushed through each head `chunk_size` at a
time, and log_softmax, KL and argmax are taken in float32 on that chunk. Peak beyond the two forwards and the two
hidden states: about 6 × chunk_size × vocab × 4 bytes (both log-probabilities, the dense probabilities, the
difference and the product that the KL sums, a boolean mask), 0.47 GB for chunk_size=128 and a 151,936-word
vocabulary; the float32 logits of a chunk are freed as soon as their log_softmax exists. A model whose logits are not
simply head(hidden) falls back to its full logits, materialised once per model and batch (never a float32 copy of
them), and still reduced chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..utils.lm_head import states_and_head
from ..utils.torch_utils import input_device
from .perplexity import evaluation_windows, scored_stream, window_batches, window_step


@dataclass
class FidelityResult:
    """Fidelity of a compressed model to a dense one, and the protocol that produced it.

    Attributes:
        kl: mean over scored tokens of KL(p_dense ‖ p_compressed) in nats (sum over the vocabulary per token).
        top1_agreement: share of scored tokens where both models' most likely next token is the same.
        dense_nll: mean negative log-likelihood of the dense model on the scored tokens (its perplexity is exp).
        compressed_nll: the same for the compressed model; equal to `perplexity(compressed, ...).nll` up to float
            round-off, since the windows and scored tokens are the same.
        scored_tokens, seqlen, stride, windows, bos: the evaluation protocol, as in `PerplexityResult`.
        chunk_size: positions reduced at a time (the peak memory depends on it, the result does not).
    """

    kl: float
    top1_agreement: float
    dense_nll: float
    compressed_nll: float
    scored_tokens: int
    seqlen: int
    stride: int
    windows: int
    bos: bool
    chunk_size: int

    @property
    def dense_perplexity(self) -> float:
        return math.exp(self.dense_nll)

    @property
    def compressed_perplexity(self) -> float:
        return math.exp(self.compressed_nll)

    def protocol(self) -> str:
        return (
            f"{self.scored_tokens} scored tokens, {self.windows} windows of {self.seqlen}, stride {self.stride}, "
            f"BOS {'prepended' if self.bos else 'not prepended'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "dense_perplexity": self.dense_perplexity,
            "compressed_perplexity": self.compressed_perplexity,
            "protocol": self.protocol(),
        }


@torch.no_grad()
def fidelity(
    dense: nn.Module,
    compressed: nn.Module,
    tokens: torch.Tensor,
    seqlen: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4,
    bos_token_id: int | None = None,
    chunk_size: int = 128,
) -> FidelityResult:
    """Mean per-token KL(dense ‖ compressed) and top-1 agreement over the windows `perplexity` would score.

    Both models read the same windows (each on its own input device; the reduction runs on the dense model's
    output device) and every position whose next token `perplexity` scores is compared: KL of the two next-token
    distributions, and whether their argmax agrees. The dense model's and the compressed model's NLL on those tokens
    come out of the same pass.

    Args:
        dense: the reference causal LM (the original model).
        compressed: the causal LM compared with it; same vocabulary.
        tokens: 1-D token stream (see `tokenize_corpus`).
        seqlen, stride, max_tokens, batch_size, bos_token_id: as in `perplexity`.
        chunk_size: scored positions pushed through the heads at a time; peak extra memory is about
            6 × chunk_size × vocab × 4 bytes (see the module docstring), the result does not depend on it.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}.")
    stride = seqlen if stride is None else stride
    stream = scored_stream(tokens, max_tokens)
    windows = evaluation_windows(stream.numel(), seqlen, stride, bos=bos_token_id is not None)
    if not windows:
        raise ValueError("the token stream is empty: nothing to compare.")
    devices = (input_device(dense), input_device(compressed))
    modes = (dense.training, compressed.training)
    dense.eval()
    compressed.eval()
    full: set[int] = set()
    kl_sum = nll_dense = nll_compressed = 0.0
    agree = count = 0
    try:
        for ids, mask, score in window_batches(stream, windows, batch_size, bos_token_id):
            states_d, head_d = states_and_head(dense, ids.to(devices[0]), mask.to(devices[0]), full)
            states_c, head_c = states_and_head(compressed, ids.to(devices[1]), mask.to(devices[1]), full)
            rows, cols = score[:, 1:].nonzero(as_tuple=True)  # position t predicts token t + 1
            targets = ids[rows, cols + 1]
            for start in range(0, rows.numel(), chunk_size):
                r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
                logits_d = head_d(states_d[r.to(states_d.device), c.to(states_d.device)]).float()
                out = logits_d.device
                logits_c = head_c(states_c[r.to(states_c.device), c.to(states_c.device)]).to(out).float()
                if logits_c.shape[-1] != logits_d.shape[-1]:
                    raise ValueError(
                        f"the models' vocabularies differ ({logits_d.shape[-1]} vs {logits_c.shape[-1]} logits)."
                    )
                agree += int((logits_d.argmax(-1) == logits_c.argmax(-1)).sum())
                log_p = torch.log_softmax(logits_d, dim=-1)
                del logits_d
                log_q = torch.log_softmax(logits_c, dim=-1)
                del logits_c
                target = targets[start : start + chunk_size].to(out)[:, None]
                nll_dense -= float(log_p.gather(-1, target).double().sum())
                nll_compressed -= float(log_q.gather(-1, target).double().sum())
                p = log_p.exp()
                terms = p * (log_p - log_q)
                terms.masked_fill_(p == 0, 0.0)  # 0 · log 0 = 0: a token the dense model rules out adds nothing
                kl_sum += float(terms.sum(-1).double().sum())
                count += int(r.numel())
                del log_p, log_q, p, terms
            del states_d, states_c
    finally:
        dense.train(modes[0])
        compressed.train(modes[1])
    if count == 0:
        raise ValueError(f"no token was scored: the stream holds {stream.numel()} tokens; give a longer text.")
    return FidelityResult(
        kl=kl_sum / count,
        top1_agreement=agree / count,
        dense_nll=nll_dense / count,
        compressed_nll=nll_compressed / count,
        scored_tokens=count,
        seqlen=seqlen,
        stride=window_step(seqlen, stride, bos_token_id is not None),
        windows=len(windows),
        bos=bos_token_id is not None,
        chunk_size=chunk_size,
    )
