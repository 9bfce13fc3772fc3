"""transformers' Trainer with the healing loss as its loss, and the rows it reads: the one place healing subclasses
the Trainer, so that optimiser, schedule, devices, FSDP and checkpoints stay the library's. Built lazily: importing
this module imports no Trainer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .distill import Objective


class _Rows(torch.utils.data.Dataset):
    """Training rows (token ids, mask, labels) as the Trainer's dataset."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def _distillation_trainer_class() -> type:
    """A Trainer whose `compute_loss` is the healing loss (built lazily: importing this module imports no Trainer)."""
    from transformers import Trainer

    class DistillationTrainer(Trainer):
        """transformers' Trainer with the healing loss; everything else (optimiser, schedule, devices) is the
        library's.

        An optimiser step's loss is the mean over every position it scores, whichever micro-batch (gradient
        accumulation) or process (DDP, FSDP) a position falls in: each batch's mean is weighted by its share of the
        step's positions, as the Trainer does for a model's own loss with ``num_items_in_batch``. A per-batch mean
        would weigh a token of a short (padded or masked) row above one of a full row, so that accumulated or
        data-parallel batches trained another objective than one batch of the same rows, and than the gate scores.
        """

        # The loss is normalised over the whole step here, so the Trainer must not divide it by the accumulation.
        loss_is_scaled_for_ga = True

        def __init__(self, *args: Any, healing_loss: Objective, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.healing_loss = healing_loss
            # transformers releases without `loss_is_scaled_for_ga` take a loss as scaled when the model "accepts
            # loss kwargs" and the step's count is given, which `get_batch_samples` below always gives.
            self.model_accepts_loss_kwargs = "loss_is_scaled_for_ga" not in vars(Trainer)

        def get_batch_samples(
            self, epoch_iterator: Any, num_batches: int, device: torch.device
        ) -> tuple[list[Any], torch.Tensor]:
            """The step's micro-batches and the positions they score on every process (the healing loss's count)."""
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
            count = torch.tensor([sum(self.healing_loss.tokens(batch) for batch in batches)], device=device)
            if self.accelerator.num_processes > 1:
                count = self.accelerator.gather(count)
            return batches, count.sum()

        def compute_loss(
            self,
            model: nn.Module,
            inputs: dict[str, torch.Tensor],
            return_outputs: bool = False,
            num_items_in_batch: torch.Tensor | int | None = None,
            **_: Any,
        ) -> Any:
            parts = self.healing_loss(model, inputs)
            loss = parts.total
            if num_items_in_batch is not None:
                # The processes' gradients are averaged, hence the factor: the step's sum over its positions.
                share = parts.tokens * self.accelerator.num_processes / max(int(num_items_in_batch), 1)
                loss = loss * share
            return (loss, None) if return_outputs else loss

    return DistillationTrainer
