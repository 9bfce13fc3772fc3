"""How much memory a device has free now: what a choice that depends on fitting (the default healing mode) reads."""

from __future__ import annotations

import torch


def available_bytes(device: torch.device | str) -> int:
    """Bytes that can still be allocated on `device`: the CUDA driver's free memory for a GPU, the operating system's
    available memory (free plus reclaimable cache, psutil's ``available``) for the CPU.

    Raises:
        ValueError: a device type other than cpu or cuda (nothing to read its free memory from).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        import psutil  # a dependency of accelerate, which the Trainer needs

        return int(psutil.virtual_memory().available)
    raise ValueError(f"cannot read the free memory of a {device.type!r} device; only cpu and cuda are supported.")
