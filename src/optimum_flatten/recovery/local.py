"""Mode 'local': each changed span trained alone towards the teacher's state at the end of the span it replaced.

The FuseGPT / LLM-Streamline recipe: a student block that stands for original layers ``start .. end - 1`` (see
`selection.changed_spans`) is fed the teacher's state entering layer ``start`` and trained so that its output matches
the teacher's state entering layer ``end``. The input is the teacher's, not the student's own upstream output
(teacher forcing), so the spans do not depend on each other: the sum of their losses is separable, and one AdamW
over all the changed blocks is the same as one optimiser per span. No backward goes through the whole model, and no
LM head runs: a step costs the teacher's layers up to the last span's end (no grad) plus a forward and a backward
of the changed blocks only.

"Cached inputs". The teacher runs once per batch and its states at every span boundary serve every span; since the
token budget reads each row once (no second epoch), caching the states of the whole text beforehand would compute
the same states at the cost of keeping them all.

Call arguments. Each block is called as the student model itself would call it in its position (mask of that
layer's type, rotary embeddings, position ids), recorded by the calibration's `LayerwiseRunner` on the student
for the batch (one embedding lookup); the teacher's states come from the same runner on the teacher, through
`CalibratedStates` (the teacher's own layers, one at a time, each with its own arguments).

Loss. Per span, the block's output against the teacher's end state over real tokens (padding masked), made
scale-free so that a span deep in the residual stream does not outweigh a shallow one: `distill.normalised_mse`
(``state_loss="pooled"``: the mean square error over the target's mean square) or `distill.token_normalised_mse`
(``"per_token"``: each position's error relative to its own state, so that positions with large states, whose
errors are large too, do not outweigh the others). The objective is the mean over spans.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..adapters import get_adapter
from ..calibration.capture import LayerwiseRunner, _to_device
from ..calibration.data import CalibrationBatch
from ..calibration.states import CalibratedStates
from ..utils.torch_utils import first_output, module_device
from .distill import LossParts, state_loss_function
from .selection import Span


class LocalSpanLoss:
    """The local objective of one batch (see the module docstring); called as ``loss(model, inputs)`` like
    `DistillationLoss`, so the Trainer and the gate take either.

    Args:
        student: The compressed model whose blocks are trained.
        teacher: The frozen dense model (eval, no grad, in the student's dtype, on the student's device).
        spans: The changed spans (`selection.changed_spans`).
        state_loss: How states are compared (`distill.state_loss_function`): ``pooled`` or ``per_token``.

    Raises:
        ValueError: when a span reaches past the teacher's layers (a teacher of another depth), or an unknown
            `state_loss`.
    """

    def __init__(
        self, student: nn.Module, teacher: nn.Module, spans: Sequence[Span], state_loss: str = "pooled"
    ) -> None:
        if not spans:
            raise ValueError("mode='local' needs at least one changed span to train.")
        self.compare = state_loss_function(state_loss)
        self.student_adapter = get_adapter(student)
        self.teacher_adapter = get_adapter(teacher)
        self.teacher_layers = list(self.teacher_adapter.layers())
        reach = max(span.end for span in spans)
        if reach > len(self.teacher_layers):
            raise ValueError(
                f"the report's plan reaches original layer {reach - 1} but the teacher has {len(self.teacher_layers)} "
                "blocks; give the dense model the checkpoint was compressed from."
            )
        self.spans = list(spans)
        self.blocks = [self.student_adapter.layers()[span.block] for span in self.spans]
        self.boundaries = sorted({span.start for span in spans} | {span.end for span in spans})

    def span_outputs(
        self, inputs: dict[str, torch.Tensor]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """((each span's block output on the teacher's entering state, the teacher's leaving state), in `spans`
        order; the batch's attention mask). The outputs carry the graph; the teacher's states do not."""
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        batch = [CalibrationBatch(input_ids=ids, attention_mask=mask)]
        with torch.no_grad():
            teacher = CalibratedStates(
                LayerwiseRunner(self.teacher_adapter, batch), self.teacher_layers, keep=self.boundaries
            )
            states = {i: teacher.boundary(i)[0] for i in self.boundaries}  # one pass: each starts where the last ended
        student_kwargs = LayerwiseRunner(self.student_adapter, batch).layer_kwargs
        pairs = []
        for span, block in zip(self.spans, self.blocks, strict=True):
            device = module_device(block)
            dtype = next(block.parameters()).dtype
            kwargs = _to_device(student_kwargs[span.block][0], device)
            output = first_output(block(states[span.start].to(device=device, dtype=dtype), **kwargs))
            pairs.append((output, states[span.end]))
        return pairs, mask

    def span_terms(self, inputs: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """(the state loss of each span, in `spans` order, real tokens of the batch); the terms carry the graph."""
        pairs, mask = self.span_outputs(inputs)
        return [self.compare(output, target, mask) for output, target in pairs], self.tokens(inputs)

    def tokens(self, inputs: dict[str, torch.Tensor]) -> int:
        """The real tokens of a batch, which the state loss compares."""
        mask = inputs.get("attention_mask")
        return int(inputs["input_ids"].numel() if mask is None else (mask != 0).sum())

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> LossParts:
        """The mean over spans of the state loss (`model` is the student the blocks belong to; the Trainer passes
        it, possibly wrapped, and only its blocks run)."""
        terms, tokens = self.span_terms(inputs)
        total = torch.stack([t.to(terms[0].device) for t in terms]).mean()
        value = float(total.detach())
        return LossParts(total=total, kl=0.0, lm=0.0, hidden=value, tokens=tokens)
