"""ViT image encoders (``ViTModel``, ``ViTForImageClassification``): pre-LayerNorm blocks fed with pixel values.

Module layout bound here (transformers 5.x, checked on 5.23, ``models/vit/modeling_vit.py``): ``model.vit.layers[i]``
(``model.layers[i]`` for a bare ``ViTModel``) is a ``ViTLayer`` with ``layernorm_before`` -> ``attention`` (a
``ViTAttention`` with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``; it reshapes with ``head_dim`` and keeps
``num_attention_heads`` as an informational attribute) -> residual, then ``layernorm_after`` -> ``mlp`` (``fc1`` ->
``activation_fn`` -> ``fc2``, not gated) -> residual; ``model.vit.embeddings`` (patch projection, CLS token, learned
position embeddings) and the final ``model.vit.layernorm``.

Version note: transformers 4.x named these ``vit.encoder.layer[i].attention.attention.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense`` and ``output.dense`` (with ``num_attention_heads``,
``attention_head_size`` and ``all_head_size`` read at run time). transformers 5 renamed them to the layout above and
converts old checkpoints on load (``conversion_mapping.py``, "ViTModel"); this adapter binds the 5.x names only.

Calibration is images: a `CalibrationBatch` carries ``pixel_values`` (see `calibration/data.py`), `forward_inputs`
feeds them to the base model and `token_mask` marks every position (CLS + patches) as real. There is no LM head, so
SLEB is refused; FlattenGPT's maths holds (pre-LN, LayerNorm gains and biases fold into q/k/v and fc1, members run
in parallel on one input, the non-gated MLP prunes by channel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..utils.errors import CalibrationDataError
from ..utils.torch_utils import input_device, model_dtype
from .base import PRE_NORM_CAPABILITIES, ArchitectureAdapter
from .checks import check_encoder_forward
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .registry import register_adapter

#: The ViTLayer (5.x names). ``num_attention_heads`` is informational in 5.23 (it reshapes with ``head_dim``); 4.x read
#: the head count at run time, which is why it must never go stale.
VIT_LAYOUT = BlockLayout(
    stack="encoder",
    attention=AttentionLayout(
        path="attention",
        layer_idx=None,
        position_scheme="learned",
        size_attributes=(("num_attention_heads", "heads"),),
    ),
    mlp=MlpLayout(up="fc1", gate=None, down="fc2", activation="activation_fn"),
    attn_norm="layernorm_before",
    mlp_norm="layernorm_after",
    norm_kind="layer",
    final_norm="layernorm",
    lm_head=False,
)


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def _pixel_values(batch: Any) -> torch.Tensor:
    """The batch's images, or a CalibrationDataError saying how to give images when it is a text batch."""
    pixel_values = getattr(batch, "pixel_values", None)
    if pixel_values is None:
        raise CalibrationDataError(
            "ViT calibrates on images, got a text batch (no pixel_values); pass dataset= a (N, C, H, W) tensor of "
            "pixel values, a list of image tensors, or images with an image processor (see docs/adapters/vit.md)."
        )
    return pixel_values


@register_adapter
class ViTAdapter(ArchitectureAdapter):
    """Pre-LN ViT encoder: learned absolute positions, a CLS token, full multi-head attention, a GELU MLP."""

    model_types = ("vit",)
    layouts = (VIT_LAYOUT,)
    capabilities = PRE_NORM_CAPABILITIES
    calibrates_on: ClassVar[str] = "images"
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "gated_mlp": "ViT's MLP is fc1 -> GELU -> fc2 without a gate projection",
    }

    # ----------------------------------------------------------------- reading
    def embeddings(self) -> nn.Module:
        """``vit.embeddings``: patch projection, CLS token and position embeddings (what makes layer 0's input)."""
        return self.base_model().embeddings

    def position_embeddings(self) -> nn.Parameter:
        """The learned (1, 1 + num_patches, hidden) position table, added after the CLS token is prepended."""
        return self.base_model().embeddings.position_embeddings

    def num_positions(self, pixel_values: torch.Tensor) -> int:
        """CLS + patches for images of `pixel_values`' height and width (no interpolation)."""
        return self._positions(pixel_values.shape[-2], pixel_values.shape[-1])

    def image_positions(self) -> int:
        """CLS + patches of an image at the config's ``image_size``: a calibration row's length (`estimate`)."""
        return self._positions(*_pair(self.config.image_size))

    def _positions(self, height: int, width: int) -> int:
        patch_h, patch_w = _pair(self.config.patch_size)
        return 1 + (height // patch_h) * (width // patch_w)

    def forward_inputs(self, stack: str, batch: Any, device: torch.device) -> dict[str, Any]:
        """``{"pixel_values": ...}``: ViTModel embeds the images itself (text batches are refused)."""
        self._check_stack(stack)
        return {"pixel_values": _pixel_values(batch).to(device)}

    def token_mask(self, stack: str, batch: Any) -> torch.Tensor:
        """All ones over CLS + patches: every position of an image is real."""
        pixel_values = _pixel_values(batch)
        return torch.ones(pixel_values.shape[0], self.num_positions(pixel_values), dtype=torch.long)

    # ------------------------------------------------------------------ config
    def update_config_(self, stack: str, first_indices: Sequence[int]) -> None:
        """Also keeps ``qkv_bias`` true to the weights: a LayerNorm folded into q/k/v (FlattenGPT, CoMe with
        ``fold_norms``) gives them its bias, which a ``qkv_bias=False`` config would drop on reload. Then every layer
        without one gets an exact zero bias and the config says ``qkv_bias=True``: one config, the same function."""
        super().update_config_(stack, first_indices)
        if getattr(self.config, "qkv_bias", True):
            return
        projections = [getattr(b.attention, n).module for b in self.blocks(stack) for n in ("q", "k", "v")]
        if all(p.bias is None for p in projections):
            return
        for projection in projections:
            if projection.bias is None:
                device = "cpu" if projection.weight.is_meta else projection.weight.device  # offloaded: held here
                zeros = torch.zeros(projection.out_features, dtype=projection.weight.dtype, device=device)
                projection.bias = nn.Parameter(zeros, requires_grad=projection.weight.requires_grad)
        self.config.qkv_bias = True

    # -------------------------------------------------------------- validating
    def check_forward(self) -> None:
        """One tiny forward on random images runs and gives finite states for CLS + every patch."""
        height, width = _pair(self.config.image_size)
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, self.config.num_channels, height, width, generator=generator)
        pixels = pixels.to(device=input_device(self.model), dtype=model_dtype(self.model))
        expected = (1, self.num_positions(pixels), self.config.hidden_size)
        check_encoder_forward(self.base_model(), {"pixel_values": pixels}, expected, "ViT")
