"""Mode 'lora' of the healing: PEFT adapters on the projections the architecture adapter exposes, merged back
into plain weights after training (`recovery.trainer`)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in every block: attention's q, k, v and o,
    and the MLP's up, gate and down. On a model with a mixture-of-experts block, attention's only: its experts are
    no single projection (transformers 5 fuses them into 3-D parameters), and peft maps every target named like an
    MLP projection onto those fused parameters (its v4-to-v5 conversion), which it adapts only without dropout."""
    adapter = get_adapter(model)
    attention, mlp, mixture = set(), set(), False
    for block in adapter.blocks():
        attention.update(id(getattr(block.attention, name).module) for name in ("q", "k", "v", "o"))
        for name in ("up", "gate", "down"):
            try:
                view = getattr(block.mlp, name)
                if view is not None:
                    mlp.add(id(view.module))
            except AttributeError:  # a mixture-of-experts block
                mixture = True
    wanted = attention if mixture else attention | mlp
    return sorted({name.split(".")[-1] for name, module in model.named_modules() if id(module) in wanted})


def adapter_seed(seed: int) -> int:
    """The seed the adapters start from: a hash of the healing's `seed`, so that the adapters' initial draw is not
    the stream the Trainer seeds later with the same number (its dropout masks and data order)."""
    digest = hashlib.sha256(f"{seed}:lora-adapters".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def wrap_lora(model: nn.Module, config: RecoveryConfig) -> tuple[nn.Module, Any]:
    """The peft-wrapped model and its LoraConfig.

    The adapters are drawn under a forked random state seeded from `config.seed` (`adapter_seed`): peft draws its
    A matrices from torch's global generator, which is random in every new process and is seeded by the Trainer
    only once it is built, after the adapters exist: without this, two runs of one command started from different
    adapters and `seed` did not fix the result (DDP then broadcast rank 0's draw, so only the ranks agreed). Forking
    leaves the caller's random state as it was."""
    from peft import LoraConfig, get_peft_model  # its presence is checked before any weight changes

    lora = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules or default_target_modules(model),
        layers_to_transform=config.layers_to_transform,
        task_type="CAUSAL_LM",
    )
    seed = adapter_seed(config.seed)
    # The generators the adapters may draw from: the CPU's (peft builds them there, then moves them to the base
    # layer's device) and those of the CUDA devices the model is on, each seeded alone: torch.manual_seed would also
    # queue a seed for every CUDA device, initialised or not, which the fork does not restore.
    on_cuda = {p.device.index for p in model.parameters() if p.device.type == "cuda"}
    cuda = sorted(torch.cuda.current_device() if index is None else index for index in on_cuda)
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        wrapped = get_peft_model(model, lora)
    return wrapped, lora
