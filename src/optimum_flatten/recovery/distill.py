"""The healing loss: KL(teacher ‖ student) on next-token distributions, the LM loss, and hidden-state terms.

Memory. Neither model's full logits are built (`utils.lm_head.states_and_head` records the LM head's input and
runs the head on the last position only); the scored positions are pushed through both heads `chunk_size` at a
time. Each student chunk runs under activation checkpointing, so what autograd keeps between the forward and the
backward is the chunk's hidden states, not its logits: at any time at most one chunk of logits per model exists, in
the forward and again in the backward's recomputation. A model whose logits are not simply head(hidden) (a post-head
soft-cap or scale) is recognised there and uses its full logits instead, still reduced chunk by chunk.

Scaling. The KL is taken at temperature T on both distributions and multiplied by T², the usual convention
(Hinton et al., 2015): the gradients of a softened KL shrink as 1/T², and the factor keeps the KL term's weight
against the LM loss independent of T. At T = 1 the term is the plain KL.

Masking. Position t predicts token t + 1; it is scored when both positions are real tokens (attention_mask 1) and
the label of t + 1 is not -100, for the KL as for the LM loss. Hidden-state terms use every real position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..utils.lm_head import Head, states_and_head


@dataclass
class LossParts:
    """One batch's loss and its parts (floats except `total`, which carries the graph).

    Attributes:
        total: What is minimised: ``kd_alpha · T² · kl + (1 - kd_alpha) · lm + hidden_weight · hidden`` with a
            teacher, ``lm`` without one.
        kl: Mean over scored positions of KL(p_teacher ‖ p_student) at temperature T, in nats (0 without teacher).
        lm: Mean next-token negative log-likelihood of the student on the scored positions (T = 1).
        hidden: Mean over student blocks of the normalised hidden-state MSE (0 when not asked for).
        tokens: Scored positions.
    """

    total: torch.Tensor
    kl: float
    lm: float
    hidden: float
    tokens: int


class Objective(Protocol):
    """A healing objective (`DistillationLoss`, `local.LocalSpanLoss`): one batch's `LossParts` for a model, whose
    `total` is a mean over the positions `tokens(inputs)` counts. The Trainer weights each batch of an optimiser
    step by that count (`distillation_trainer`), so the count must be known before the forward."""

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> LossParts: ...

    def tokens(self, inputs: dict[str, torch.Tensor]) -> int: ...


def scored_positions(
    attention_mask: torch.Tensor | None, labels: torch.Tensor | None, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, columns, targets) of the positions whose next token is scored (see the module docstring)."""
    rows, cols = scored_mask(attention_mask, labels, input_ids).nonzero(as_tuple=True)
    source = labels if labels is not None else input_ids
    return rows, cols, source[rows, cols + 1]


def scored_mask(
    attention_mask: torch.Tensor | None, labels: torch.Tensor | None, input_ids: torch.Tensor
) -> torch.Tensor:
    """Whether each position t < last is scored: t and t + 1 are real tokens and the label of t + 1 is not -100."""
    valid = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if attention_mask is not None:
        valid &= (attention_mask[:, :-1] != 0) & (attention_mask[:, 1:] != 0)
    if labels is not None:
        valid &= labels[:, 1:] != -100
    return valid


def _chunk_terms(
    student_states: torch.Tensor,
    teacher_states: torch.Tensor | None,
    targets: torch.Tensor,
    student_head: Head,
    teacher_head: Head | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of KL, sum of NLL) over one chunk of positions, in float32."""
    logits = student_head(student_states).float()
    nll = nn.functional.cross_entropy(logits, targets, reduction="sum")
    if teacher_head is None or teacher_states is None:
        return logits.new_zeros(()), nll
    with torch.no_grad():
        log_p = torch.log_softmax(teacher_head(teacher_states).float() / temperature, dim=-1)
    if log_p.shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"the teacher's and the student's vocabularies differ ({log_p.shape[-1]} vs {logits.shape[-1]} logits)."
        )
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    p = log_p.exp()
    terms = (p * (log_p - log_q)).masked_fill(p == 0, 0.0)  # 0 · log 0 = 0
    return terms.sum(), nll


def chunked_next_token_terms(
    student_states: torch.Tensor,
    student_head: Head,
    rows: torch.Tensor,
    cols: torch.Tensor,
    targets: torch.Tensor,
    teacher_states: torch.Tensor | None = None,
    teacher_head: Head | None = None,
    temperature: float = 1.0,
    chunk_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of KL(teacher ‖ student) at T, sum of student NLL) over the positions (rows, cols), chunk by chunk.

    `student_states` / `teacher_states` are per-position states (batch × seq × hidden) mapped to logits by the
    heads (or full logits with the identity as head). With grad enabled, each chunk is checkpointed so that its
    logits are recomputed in the backward instead of kept.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}.")
    kl = student_states.new_zeros((), dtype=torch.float32)
    nll = student_states.new_zeros((), dtype=torch.float32)
    keep_graph = torch.is_grad_enabled() and student_states.requires_grad
    for start in range(0, rows.numel(), chunk_size):
        r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
        s = student_states[r, c]
        t = None if teacher_states is None else teacher_states[r.to(teacher_states.device), c.to(teacher_states.device)]
        t = None if t is None else t.to(s.device)
        y = targets[start : start + chunk_size].to(s.device)

        def terms(s: torch.Tensor, t: torch.Tensor | None = t, y: torch.Tensor = y) -> tuple[torch.Tensor, ...]:
            return _chunk_terms(s, t, y, student_head, teacher_head, temperature)

        chunk_kl, chunk_nll = checkpoint(terms, s, use_reentrant=False) if keep_graph else terms(s)
        kl = kl + chunk_kl
        nll = nll + chunk_nll
    return kl, nll


def normalised_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean square of (student - teacher) over real positions, divided by the teacher's mean square there.

    The division makes each layer's term scale-free: a residual stream grows with depth, and without it the last
    blocks' terms would outweigh the first ones by orders of magnitude.
    """
    diff = (student.float() - teacher.float().to(student.device)) ** 2
    ref = teacher.float().to(student.device) ** 2
    if mask is not None:
        keep = (mask != 0).to(student.device)
        diff, ref = diff[keep], ref[keep]
    return diff.mean() / ref.mean().clamp_min(torch.finfo(torch.float32).tiny)


def token_normalised_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real positions of each position's squared error divided by its own target's squared norm.

    `normalised_mse` weighs a position by the size of its error, which grows with the size of its state: on these
    models the states differ in norm by orders of magnitude (the first position of a row, the attention sink, holds
    93–98% of the target's pooled mean square on the bridged spans of SmolLM2-135M and Qwen2.5-0.5B; its error is
    ~0–1% of the pooled error, but among the other positions the large ones still dominate). Every later layer reads
    the stream through a per-position norm, so what a position's error does downstream is relative to its own size:
    this term weighs every real position's relative error alike, invariant to the scale of each.
    """
    student, teacher = student.float(), teacher.float().to(student.device)
    error = (student - teacher).pow(2).sum(-1)
    size = teacher.pow(2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    ratio = error / size
    if mask is not None:
        ratio = ratio[(mask != 0).to(student.device)]
    return ratio.mean()


#: The hidden-state and local terms, by `RecoveryConfig.state_loss`.
STATE_LOSSES = {"pooled": normalised_mse, "per_token": token_normalised_mse}


def state_loss_function(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The comparison `RecoveryConfig.state_loss` names (`STATE_LOSSES`); an unknown name is refused here, once for
    the local mode and the hidden-state terms alike."""
    if name not in STATE_LOSSES:
        raise ValueError(f"state_loss must be one of {sorted(STATE_LOSSES)}, got {name!r}.")
    return STATE_LOSSES[name]


def _first_tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


@contextlib.contextmanager
def _record_blocks(blocks: Sequence[nn.Module], store: dict[int, torch.Tensor]) -> Iterator[None]:
    """Records the output of each of `blocks` (by its position in `blocks`) during a forward."""
    handles = []
    for index, block in enumerate(blocks):

        def keep_output(_module: nn.Module, _args: Any, output: Any, index: int = index) -> None:
            store[index] = _first_tensor(output)

        handles.append(block.register_forward_hook(keep_output))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forward_states(
    model: nn.Module, inputs: dict[str, torch.Tensor], blocks: Sequence[nn.Module] = (), full: set[int] | None = None
) -> tuple[torch.Tensor, Head, list[torch.Tensor]]:
    """(per-position states, head mapping them to logits, outputs of `blocks`) of one forward of `model`.

    `full` remembers the models whose logits are more than head(hidden) (see `utils.lm_head`), across batches.
    """
    store: dict[int, torch.Tensor] = {}
    with _record_blocks(blocks, store):
        states, head = states_and_head(
            model, inputs["input_ids"], inputs.get("attention_mask"), full if full is not None else set()
        )
    return states, head, [store[i] for i in range(len(blocks))]


@dataclass
class DistillationLoss:
    """The loss of one batch for the Trainer: see the module docstring.

    Attributes:
        teacher: The frozen dense model (eval, no grad, in the student's dtype), or None for the LM loss alone.
        temperature: T of the softened distributions (the KL term is scaled by T²).
        kd_alpha: Weight of the KL term; the LM loss gets 1 - kd_alpha. Ignored without a teacher.
        hidden_weight: Weight of the hidden-state terms (0 turns them off).
        student_blocks: The student's blocks whose outputs are compared (with hidden_weight > 0).
        teacher_blocks: For each student block, the teacher block that ends the span it stands for.
        chunk_size: Positions pushed through the heads at a time.
        state_loss: How a hidden-state term compares states (`STATE_LOSSES`): ``pooled`` (`normalised_mse`) or
            ``per_token`` (`token_normalised_mse`).
    """

    teacher: nn.Module | None = None
    temperature: float = 1.0
    kd_alpha: float = 1.0
    hidden_weight: float = 0.0
    student_blocks: Sequence[nn.Module] = ()
    teacher_blocks: Sequence[nn.Module] = ()
    chunk_size: int = 128
    state_loss: str = "pooled"
    #: Models found to have logits that are more than head(hidden), so that the check runs once per model.
    full_logits: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}.")
        if not 0.0 <= self.kd_alpha <= 1.0:
            raise ValueError(
                f"kd_alpha must be in [0, 1] (the weight of the KL against the LM loss), got {self.kd_alpha}."
            )
        if self.hidden_weight < 0:
            raise ValueError(f"hidden_weight must be at least 0, got {self.hidden_weight}.")
        state_loss_function(self.state_loss)  # refused now, before any training
        if self.hidden_weight > 0 and (self.teacher is None or not self.student_blocks):
            raise ValueError(
                "hidden-state terms (hidden_weight > 0) need a teacher and a layer map of the student's blocks to the "
                "teacher's spans (the compression report's plan); give both, or set hidden_weight to 0."
            )
        if len(self.student_blocks) != len(self.teacher_blocks):
            raise ValueError(
                f"got {len(self.student_blocks)} student blocks but {len(self.teacher_blocks)} teacher span ends."
            )

    def tokens(self, inputs: dict[str, torch.Tensor]) -> int:
        """The positions a batch's KL and LM means run over (`scored_mask`)."""
        return int(scored_mask(inputs.get("attention_mask"), inputs.get("labels"), inputs["input_ids"]).sum())

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> LossParts:
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        rows, cols, targets = scored_positions(mask, inputs.get("labels"), ids)
        hidden_on = self.hidden_weight > 0
        states, head, student_outputs = forward_states(
            model, inputs, self.student_blocks if hidden_on else (), self.full_logits
        )
        teacher_states = teacher_head = None
        teacher_outputs: list[torch.Tensor] = []
        if self.teacher is not None:
            with torch.no_grad():
                teacher_states, teacher_head, teacher_outputs = forward_states(
                    self.teacher, inputs, self.teacher_blocks if hidden_on else (), self.full_logits
                )
        kl_sum, nll_sum = chunked_next_token_terms(
            states, head, rows, cols, targets, teacher_states, teacher_head, self.temperature, self.chunk_size
        )
        count = max(int(rows.numel()), 1)
        kl, lm = kl_sum / count, nll_sum / count
        hidden = lm.new_zeros(())
        if hidden_on:
            compare = state_loss_function(self.state_loss)
            terms = [compare(s, t, mask) for s, t in zip(student_outputs, teacher_outputs, strict=True)]
            hidden = torch.stack(terms).mean()
        if self.teacher is None:
            total = lm
        else:
            total = self.kd_alpha * self.temperature**2 * kl + (1.0 - self.kd_alpha) * lm
        total = total + self.hidden_weight * hidden
        return LossParts(total, float(kl.detach()), float(lm.detach()), float(hidden.detach()), int(rows.numel()))
