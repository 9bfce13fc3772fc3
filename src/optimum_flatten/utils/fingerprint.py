"""A fingerprint of a model's weights and config, to recognise the dense model a checkpoint was compressed from.

Healing distils from a teacher, and the right teacher is the model the checkpoint was compressed from. Reports keep
no local paths (they would publish the user's file layout), so the report keeps this fingerprint instead, and
`recover` warns when the teacher it is given does not match it.

What is hashed: the config's architecture fields (model type, widths, depth, vocabulary; not its name or path) and,
for every parameter in name order, its name, shape and its first `SAMPLE` values rounded to bfloat16 (so the same
weights loaded in float32, bfloat16 or float16 from a float32 checkpoint agree: the dtype a teacher is loaded in is
the student's, not necessarily the one the checkpoint was compressed in). Sampling keeps
the cost a small read per tensor (a full checksum of a 70B model reads 140 GB, and of an offloaded one onloads every
weight); two checkpoints that differ only past the first values of every tensor would collide, which a fine-tune or
another seed does not do.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
from torch import nn

#: Values of each parameter read into the fingerprint (the first ones of its flattened storage).
SAMPLE = 64

#: Config fields that describe the architecture (absent ones are skipped).
CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def weights_fingerprint(model: nn.Module) -> str:
    """A hex digest of `model`'s architecture fields and a sample of every parameter (see the module docstring)."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    fields = {name: getattr(config, name) for name in CONFIG_FIELDS if hasattr(config, name)}
    digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    offloaded = _offloaded_weights(model)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            digest.update(f"{name}:{tuple(parameter.shape)}".encode())
            if parameter.device.type == "meta":
                parameter = _offloaded(offloaded, name)
                if parameter is None:  # no values anywhere (a model built on meta): its shape alone counts
                    continue
            values = parameter.detach().reshape(-1)[:SAMPLE].to("cpu").to(torch.bfloat16).to(torch.float64)
            digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:32]


def _offloaded_weights(model: nn.Module) -> dict[str, Any]:
    """Module prefix -> the weights map of each module accelerate offloads (its parameters sit on the meta device in
    the model; the values are in CPU memory or a memory-mapped file on disk, read back by name): so that an offloaded
    layer counts as what it holds, whatever the device map."""
    found = {}
    for prefix, module in model.named_modules():
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is not None:
            found[prefix] = weights
    return found


def _offloaded(offloaded: dict[str, Any], name: str) -> torch.Tensor | None:
    """The stored values of the offloaded parameter `name` (None where no hook keeps it)."""
    for prefix in sorted(offloaded, key=len, reverse=True):
        if prefix and not name.startswith(prefix + "."):
            continue
        relative = name[len(prefix) + 1 :] if prefix else name
        try:
            value = _leading_values(offloaded[prefix], relative)
        except KeyError:
            continue
        return value if isinstance(value, torch.Tensor) and value.device.type != "meta" else None
    return None


def _leading_values(weights: Any, key: str) -> torch.Tensor:
    """The rows holding the first `SAMPLE` values of the offloaded weight `key`, read without loading the rest: from
    accelerate's loader (a ``PrefixedDataset`` over an ``OffloadedWeightsLoader``) a safetensors slice or rows of a
    memory-mapped ``.dat`` file, since a 70B model's disk-offloaded weights are far too many to read whole for a
    fingerprint. Anything else is read through the mapping, whole."""
    loader, full = getattr(weights, "dataset", None), getattr(weights, "prefix", "") + key
    info = getattr(loader, "index", {}).get(full) if loader is not None else None
    if info is None or full in getattr(loader, "state_dict", {}):
        return weights[key]  # in memory already, or a mapping this code does not know
    if info.get("safetensors_file") is not None:
        from safetensors import safe_open

        with safe_open(info["safetensors_file"], framework="pt", device="cpu") as handle:
            values = handle.get_slice(info.get("weight_name", full))
            shape = tuple(values.get_shape())
            return values[_leading_rows(shape)] if shape else handle.get_tensor(info.get("weight_name", full))
    import numpy as np

    shape, dtype = tuple(info["shape"]) or (1,), info["dtype"]
    rows = _leading_rows(shape)
    stored = {"bfloat16": "int16"}.get(dtype, "int8" if dtype.startswith("float8_") else dtype)
    row = torch.tensor(
        np.array(np.memmap(os.path.join(loader.save_folder, f"{full}.dat"), stored, "r", shape=shape)[rows])
    )
    return row.view(getattr(torch, dtype)) if stored != dtype else row


def _leading_rows(shape: tuple[int, ...]) -> slice:
    """The rows of a weight of `shape` that hold its first `SAMPLE` values (all of a vector's first ones)."""
    row = math.prod(shape[1:])
    return slice(0, -(-SAMPLE // row)) if row else slice(None)
