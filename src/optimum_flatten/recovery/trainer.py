"""LoRA recovery with transformers' Trainer and peft, merged back into a plain checkpoint."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from .data import build_training_rows, load_recovery_texts

logger = logging.getLogger(__name__)


@dataclass
class RecoveryConfig:
    """The FlattenGPT paper's recipe by default: LoRA r=8, alpha=16, lr 1e-4, 2 epochs on Alpaca-format data.

    Attributes:
        r, lora_alpha, lora_dropout: LoRA shape.
        learning_rate, num_train_epochs, max_steps: Optimisation (max_steps > 0 overrides the epochs).
        per_device_train_batch_size, gradient_accumulation_steps: Batch shape.
        seqlen: Tokens per training row.
        max_samples: Train on at most this many rows (seeded choice); None uses all.
        target_modules: Module names LoRA wraps; None takes every projection the architecture adapter exposes
            (q, k, v, o, gate, up, down; W_pack for Baichuan).
        layers_to_transform: Restrict LoRA to these layer indices of the compressed model (renumbered, 0-based).
        logging_steps, seed: As in TrainingArguments.
    """

    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    learning_rate: float = 1e-4
    num_train_epochs: float = 2.0
    max_steps: int = -1
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    seqlen: int = 256
    max_samples: int | None = None
    target_modules: list[str] | None = None
    layers_to_transform: list[int] | None = None
    logging_steps: int = 10
    seed: int = 0
    extra_training_args: dict[str, Any] = field(default_factory=dict)


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in the first block."""
    adapter = get_adapter(model)
    block = adapter.blocks()[0]
    views = [block.attention.q, block.attention.k, block.attention.v, block.attention.o, block.mlp.up, block.mlp.down]
    if block.mlp.gate is not None:
        views.append(block.mlp.gate)
    wanted = {id(v.module) for v in views}
    names = {name.split(".")[-1] for name, module in block.module.named_modules() if id(module) in wanted}
    return sorted(names)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def recover(
    model: nn.Module, tokenizer: Any, dataset: Any, config: RecoveryConfig | None = None, text_column: str = "text"
) -> tuple[nn.Module, dict[str, Any]]:
    """Trains LoRA adapters on `dataset`, merges them, and returns (plain model, training log).

    Raises:
        ImportError: when peft is missing (``pip install optimum-flatten[recovery]``).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("recovery fine-tuning needs peft: pip install optimum-flatten[recovery]") from error
    from transformers import Trainer, TrainingArguments

    config = config or RecoveryConfig()
    texts, kind = load_recovery_texts(dataset, text_column)
    rows = build_training_rows(tokenizer, texts, kind, config.seqlen, config.max_samples, config.seed)
    lora = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules or default_target_modules(model),
        layers_to_transform=config.layers_to_transform,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    with tempfile.TemporaryDirectory() as scratch:
        arguments = TrainingArguments(
            output_dir=scratch,
            learning_rate=config.learning_rate,
            num_train_epochs=config.num_train_epochs,
            max_steps=config.max_steps,
            per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            logging_steps=config.logging_steps,
            save_strategy="no",
            report_to=[],
            seed=config.seed,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            dataloader_pin_memory=torch.cuda.is_available(),
            **config.extra_training_args,
        )
        trainer = Trainer(model=peft_model, args=arguments, train_dataset=_Rows(rows))
        result = trainer.train()
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
    merged = peft_model.merge_and_unload()
    merged.eval()
    log = {
        "data_kind": kind,
        "rows": len(rows),
        "seqlen": config.seqlen,
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "loss_history": history,
        "lora": {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(lora.target_modules)},
        "learning_rate": config.learning_rate,
        "train_seconds": result.metrics.get("train_runtime"),
    }
    return merged, log
