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
        library's."""

        def __init__(self, *args: Any, healing_loss: Objective, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.healing_loss = healing_loss
            # Our loss is a mean over the batch's scored tokens, not a sum the Trainer normalises by the items in
            # the accumulated batch; so the Trainer divides it by the accumulation steps itself.
            self.model_accepts_loss_kwargs = False

        def compute_loss(
            self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False, **_: Any
        ) -> Any:
            parts = self.healing_loss(model, inputs)
            return (parts.total, None) if return_outputs else parts.total

    return DistillationTrainer
