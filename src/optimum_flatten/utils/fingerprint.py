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
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            digest.update(f"{name}:{tuple(parameter.shape)}".encode())
            if parameter.device.type == "meta":
                continue
            values = parameter.detach().reshape(-1)[:SAMPLE].to("cpu").to(torch.bfloat16).to(torch.float64)
            digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:32]
