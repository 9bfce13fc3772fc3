"""The healing loss against naive full-vocabulary references, and the teacher = student invariant."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten.recovery import RecoveryConfig, recover
from optimum_flatten.recovery.distill import DistillationLoss, normalised_mse, token_normalised_mse
from optimum_flatten.recovery.selection import span_ends


def _batch() -> dict[str, torch.Tensor]:
    """Two rows of 20 tokens; the second right-padded over its last 7, one label masked in the first."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, tiny_models.VOCAB, (2, 20), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    ids[1, -7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def _naive(student, teacher, batch, temperature: float, kd_alpha: float) -> tuple[float, float, float]:
    """(total, KL, LM) with full float64 logits and an explicit loop over scored positions."""
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    kl = lm = 0.0
    count = 0
    for b in range(s.shape[0]):
        for i in range(s.shape[1] - 1):
            if not (batch["attention_mask"][b, i] and batch["attention_mask"][b, i + 1]):
                continue
            if batch["labels"][b, i + 1] == -100:
                continue
            p = torch.softmax(t[b, i] / temperature, -1)
            q_log = torch.log_softmax(s[b, i] / temperature, -1)
            kl += float((p * (p.log() - q_log)).sum())
            lm -= float(torch.log_softmax(s[b, i], -1)[batch["labels"][b, i + 1]])
            count += 1
    kl, lm = kl / count, lm / count
    return kd_alpha * temperature**2 * kl + (1 - kd_alpha) * lm, kl, lm


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_kl_and_lm_equal_a_naive_full_vocabulary_computation_with_padding(chunk_size):
    teacher = tiny_models.tiny_llama_gqa(seed=0)
    student = tiny_models.tiny_llama_gqa(seed=5)
    batch = _batch()
    loss = DistillationLoss(teacher=teacher, temperature=2.0, kd_alpha=0.7, chunk_size=chunk_size)
    parts = loss(student, batch)
    total, kl, lm = _naive(student, teacher, batch, temperature=2.0, kd_alpha=0.7)
    assert parts.tokens == 19 + 12 - 1  # row 0: 19 positions less the masked label; row 1: 12 real next tokens
    assert parts.kl == pytest.approx(kl, rel=1e-5, abs=1e-7)
    assert parts.lm == pytest.approx(lm, rel=1e-5)
    assert float(parts.total.detach()) == pytest.approx(total, rel=1e-5)
    assert kl > 1e-3  # the two random models really disagree: the comparison is not of zeros


def test_chunked_gradient_equals_the_full_logits_gradient():
    teacher = tiny_models.tiny_llama_gqa(seed=0)
    student = tiny_models.tiny_llama_gqa(seed=5)
    batch = _batch()
    DistillationLoss(teacher=teacher, temperature=1.5, kd_alpha=0.5, chunk_size=4)(student, batch).total.backward()
    chunked = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    with torch.no_grad():
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    keep = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool() & (batch["labels"][:, 1:] != -100)
    log_p = torch.log_softmax(t[keep] / 1.5, -1)
    kl = (log_p.exp() * (log_p - torch.log_softmax(s[keep] / 1.5, -1))).sum(-1).mean()
    lm = torch.nn.functional.cross_entropy(s[keep], batch["labels"][:, 1:][keep])
    (0.5 * 1.5**2 * kl + 0.5 * lm).backward()
    for name, parameter in student.named_parameters():
        torch.testing.assert_close(chunked[name], parameter.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_student_equal_to_teacher_gives_zero_loss_and_unchanged_weights():
    model = tiny_models.tiny_llama_gqa()
    teacher = copy.deepcopy(model)
    parts = DistillationLoss(teacher=teacher)(model, _batch())
    assert float(parts.total.detach()) == 0.0 and parts.kl == 0.0
    parts.total.backward()
    # Zero up to the round-off of softmax(x) against exp(log_softmax(x)); Adam's normalisation would turn such
    # gradients into full-size steps, which is one reason the gate scores the start and keeps it when nothing beats it.
    assert max(float(p.grad.abs().max()) for p in model.parameters()) < 1e-6
    model.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = RecoveryConfig(
        mode="full",
        max_tokens=128,
        seqlen=32,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        heldout_rows=4,
        eval_every=1,
        extra_training_args={"disable_tqdm": True},
    )
    # Through `recover`, a teacher with the student's weights is a mistake (the compressed checkpoint given as its
    # own teacher): refused before any change, where it once trained for nothing.
    with pytest.raises(ValueError, match="the teacher is the model being healed"):
        recover(model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=teacher)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_the_per_token_state_loss_weighs_every_real_position_alike_whatever_its_size():
    """A massive state (the attention sink's) carries a pooled mean square but not the per-token term: scaling one
    position's student and teacher states by 1000 leaves the per-token loss unchanged and moves the pooled one."""
    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 8)
    student = teacher + 0.1 * torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    real = [(b, t) for b in range(2) for t in range(5) if mask[b, t]]
    naive = sum(float((student[b, t] - teacher[b, t]).pow(2).sum() / teacher[b, t].pow(2).sum()) for b, t in real)
    assert float(token_normalised_mse(student, teacher, mask)) == pytest.approx(naive / len(real), rel=1e-6)
    assert float(token_normalised_mse(teacher, teacher, mask)) == 0.0
    padded = student.clone()
    padded[0, 3:] = 1e6  # padding never counts
    assert float(token_normalised_mse(padded, teacher, mask)) == pytest.approx(naive / len(real), rel=1e-6)
    sink_student, sink_teacher = student.clone(), teacher.clone()
    sink_student[:, 0] *= 1000
    sink_teacher[:, 0] *= 1000
    assert float(token_normalised_mse(sink_student, sink_teacher, mask)) == pytest.approx(naive / len(real), rel=1e-5)
    pooled = float(normalised_mse(student, teacher, mask))
    assert float(normalised_mse(sink_student, sink_teacher, mask)) != pytest.approx(pooled, rel=0.1)
    with pytest.raises(ValueError, match="state_loss must be one of"):
        DistillationLoss(state_loss="cosine")


def test_hidden_terms_are_normalised_per_layer_and_zero_for_the_teacher_itself():
    teacher = torch.randn(2, 5, 8) * 100
    assert float(normalised_mse(teacher, teacher, None)) == 0.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    student = teacher * 1.1
    student[0, 3:] = 1e6  # padding never counts
    assert float(normalised_mse(student, teacher, mask)) == pytest.approx(0.01, rel=1e-5)
    model = tiny_models.tiny_llama_gqa()
    blocks = list(model.model.layers)
    twin = copy.deepcopy(model)
    same = DistillationLoss(
        teacher=twin, hidden_weight=1.0, student_blocks=blocks, teacher_blocks=list(twin.model.layers)
    )
    assert float(same(model, _batch()).total.detach()) == 0.0


def test_layer_map_puts_a_dropped_run_at_the_end_of_the_block_before_it():
    assert span_ends([[0, 1], [2], [4], [5]], 6) == [1, 3, 4, 5]
    assert span_ends([[1], [2], [3, 4]], 6) == [1, 2, 5]
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "replaceme", num_layers_to_remove=2)
    assert quantizer.report["plan"]["groups"] == [[0], [1], [4], [5]]
