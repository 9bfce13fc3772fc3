"""Mode 'lora' of the healing: PEFT adapters on the projections the architecture adapter exposes, merged back
into plain weights after training (`recovery.trainer`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..options.recovery import RecoveryConfig, check_lora_options


def default_target_modules(model: nn.Module, layers: Sequence[int] | None = None) -> list[str]:
    """Names (last path component) of the projections the adapter exposes in every block: attention's q, k, v and o,
    and the MLP's up, gate and down. On a model with a mixture-of-experts block, attention's only: its experts are
    no single projection (transformers 5 fuses them into 3-D parameters), and peft maps every target named like an
    MLP projection onto those fused parameters (its v4-to-v5 conversion), which it adapts only without dropout.

    `layers` (LoRA's ``layers_to_transform``) keeps the full paths of those blocks only: peft applies its layer
    filter to the names matched by their last component, but adapts a name matched whole wherever it is."""
    adapter = get_adapter(model)
    attention, mlp, mixture = set(), set(), False
    block_of: dict[int, int] = {}
    for block in adapter.blocks():
        attention.update(id(getattr(block.attention, name).module) for name in ("q", "k", "v", "o"))
        block_of.update({id(module): block.index for module in block.module.modules()})
        for name in ("up", "gate", "down"):
            try:
                view = getattr(block.mlp, name)
                if view is not None:
                    mlp.add(id(view.module))
            except AttributeError:  # a mixture-of-experts block
                mixture = True
    # Only layers peft can adapt: a collapsed MLP's down slot is an nn.Identity (LayerCollapse).
    from transformers.pytorch_utils import Conv1D

    adaptable = {id(m) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, Conv1D))}
    wanted = (attention if mixture else attention | mlp) & adaptable
    # peft matches a short name against every module so named; a name some other module also carries (GPT-2's
    # c_proj is attention's out projection and the MLP's down one, and the latter an nn.Identity in a partly
    # collapsed LayerCollapse model) is given by its full paths, which match those modules alone.
    modules = list(model.named_modules())
    elsewhere = {name.split(".")[-1] for name, module in modules if id(module) not in wanted}
    short = {name: name.split(".")[-1] for name, module in modules if id(module) in wanted}
    kept = {
        name for name, module in modules if id(module) in wanted and (layers is None or block_of[id(module)] in layers)
    }
    return sorted(
        {name if last in elsewhere else last for name, last in short.items() if last not in elsewhere or name in kept}
    )


def check_lora_targets(model: nn.Module, config: RecoveryConfig, layers: int) -> None:
    """Refuses, before any weight changes, LoRA settings peft would refuse only once the adapters are made (after a
    compression, whose work would be lost) or would merge wrong: target modules that name no module of `model`
    (matched as peft matches them), `layers_to_transform` outside the `layers` the healed model has (numbered after
    the compression), and an adapter on the embedding or the head where the two share one table (its merge would
    write the update into both ends). Another mode, chosen by default, refuses LoRA's options (`check_lora_options`).
    """
    if config.mode != "lora":
        check_lora_options(config, f"mode {config.mode!r}, the one chosen,")
        return
    names = [name for name, _ in model.named_modules()]
    targets = list(config.target_modules or [])
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"LoRA target_modules {missing} name no module of this {type(model).__name__}; its projections are "
            f"{default_target_modules(model)}."
        )
    whole = [t for t in targets if "." in t and t in names]
    if whole and config.layers_to_transform is not None:
        raise ValueError(
            f"LoRA target_modules {whole} are full module paths, which peft adapts whatever layers_to_transform says; "
            "name those modules by their last component, or leave layers_to_transform out."
        )
    bad = [i for i in config.layers_to_transform or () if not 0 <= i < layers]
    if bad:
        raise ValueError(
            f"LoRA layers_to_transform {bad} are not layers of the healed model, which has {layers} (numbered 0 to "
            f"{layers - 1} after the compression)."
        )
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or getattr(inputs, "weight", None) is not getattr(outputs, "weight", None):
        return
    ends = {n for n, module in model.named_modules() if module is inputs or module is outputs}
    tied = [t for t in targets if any(n == t or n.endswith("." + t) for n in ends)]
    if tied:
        raise ValueError(
            f"LoRA target_modules {tied} name the embedding or the LM head, which this model ties into one table: "
            "merging the adapter would write its update into both ends. Leave them out, or heal with mode 'full'."
        )


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
        target_modules=config.target_modules or default_target_modules(model, config.layers_to_transform),
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
