"""The distillation loss under DDP: the Trainer hands `compute_loss` the DDP wrapper, which has no
`get_output_embeddings`, so `utils.lm_head.states_and_head` took its fallback and every data-parallel step built the
student's full logits (batch × seq × vocab: 151k columns on Qwen2.5). It now looks through the wrapper for the head,
keeps the forward on the wrapper, and gives the loss one process gives."""

from __future__ import annotations

import torch

import tiny_models
from common import _free_port
from optimum_flatten.recovery.distill import DistillationLoss
from optimum_flatten.utils.lm_head import identity, states_and_head


def test_the_head_is_found_through_ddp_and_the_loss_is_one_process_s():
    torch.manual_seed(0)
    student, teacher = tiny_models.tiny_llama_gqa(), tiny_models.tiny_llama_gqa()
    ids = torch.randint(0, student.config.vocab_size, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    expected = DistillationLoss(teacher=teacher)(student, batch)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(student)
        states, head = states_and_head(wrapped, ids, batch["attention_mask"], set())
        assert head is not identity and head is student.get_output_embeddings()
        assert states.shape == (2, 12, student.config.hidden_size)  # the head's input, not the logits
        got = DistillationLoss(teacher=teacher)(wrapped, batch)
        got.total.backward()  # through the wrapper: DDP's reducer sees every parameter's gradient
    finally:
        torch.distributed.destroy_process_group()
    torch.testing.assert_close(got.total.detach(), expected.total.detach(), rtol=1e-6, atol=1e-7)
    assert (got.kl, got.lm, got.tokens) == (expected.kl, expected.lm, expected.tokens)
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
