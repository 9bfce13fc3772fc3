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
from .base import (
    ArchitectureAdapter,
    AttentionView,
    BlockView,
    HeadGeometry,
    LinearView,
    MlpView,
    NormView,
    require_unit_norms,
)
from .bert import keep_head_rows_
from .registry import register_adapter


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def _cat_biases(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("cannot concatenate blocks where only some members have a bias.")
    return torch.cat(list(biases))


def _sum_biases(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    present = [b for b in biases if b is not None]
    return torch.stack(present).sum(dim=0) if present else None


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
    default_stack = "encoder"
    capabilities = frozenset({"head_geometry", "pre_norm", "concat_heads", "layer_drop"})
    missing_capability_reasons: ClassVar[dict[str, str]] = {
        "gated_mlp": "ViT's MLP is fc1 -> GELU -> fc2 without a gate projection",
    }
    #: A ViTLayer's attention and MLP parameters; ``layernorm_before`` / ``layernorm_after`` stay the first member's.
    mergeable_prefixes: ClassVar[tuple[str, ...]] = ("attention.", "mlp.")
    applicable_methods: ClassVar[str] = "flattengpt, shortgpt, laco, sliding_window"

    # ----------------------------------------------------------------- reading
    def embeddings(self) -> nn.Module:
        """``vit.embeddings``: patch projection, CLS token and position embeddings (what makes layer 0's input)."""
        return self.base_model().embeddings

    def position_embeddings(self) -> nn.Parameter:
        """The learned (1, 1 + num_patches, hidden) position table, added after the CLS token is prepended."""
        return self.base_model().embeddings.position_embeddings

    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        return self.base_model().layernorm

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """None: ViT has no language-model head (the classifier reads the CLS token only)."""
        return None

    def num_positions(self, pixel_values: torch.Tensor) -> int:
        """CLS + patches for images of `pixel_values`' height and width (no interpolation)."""
        patch_h, patch_w = _pair(self.config.patch_size)
        return 1 + (pixel_values.shape[-2] // patch_h) * (pixel_values.shape[-1] // patch_w)

    def forward_inputs(self, stack: str, batch: Any, device: torch.device) -> dict[str, Any]:
        """``{"pixel_values": ...}``: ViTModel embeds the images itself (text batches are refused)."""
        self._check_stack(stack)
        return {"pixel_values": _pixel_values(batch).to(device)}

    def token_mask(self, stack: str, batch: Any) -> torch.Tensor:
        """All ones over CLS + patches: every position of an image is real."""
        pixel_values = _pixel_values(batch)
        return torch.ones(pixel_values.shape[0], self.num_positions(pixel_values), dtype=torch.long)

    def block_view(self, module: nn.Module, index: int) -> BlockView:
        attn, mlp = module.attention, module.mlp
        head_dim = attn.head_dim
        q = LinearView(attn, "q_proj")
        return BlockView(
            index=index,
            module=module,
            norm_position="pre",
            attn_norm=NormView(module.layernorm_before, "layer"),
            mlp_norm=NormView(module.layernorm_after, "layer"),
            attention=AttentionView(
                q=q,
                k=LinearView(attn, "k_proj"),
                v=LinearView(attn, "v_proj"),
                o=LinearView(attn, "o_proj"),
                geometry=HeadGeometry.of(q, q, head_dim),  # multi-head: one key/value head per query head
                position_scheme="learned",
                module=attn,
            ),
            mlp=MlpView(
                up=LinearView(mlp, "fc1"),
                gate=None,
                down=LinearView(mlp, "fc2"),
                activation=mlp.activation_fn,
                module=mlp,
            ),
        )

    # ---------------------------------------------------------------- mutating
    def build_concat_block(self, members: Sequence[BlockView]) -> nn.Module:
        """A ViTLayer holding every head and MLP unit of `members`, computing them in parallel on one input.

        The members' LayerNorms must be unit (folded into q/k/v and fc1 first); o_proj and fc2 biases are summed,
        since each member adds its own to the residual stream.
        """
        require_unit_norms([m.attn_norm for m in members] + [m.mlp_norm for m in members], "layernorm_before/after")
        head_dims = {m.attention.geometry.head_dim for m in members}
        if len(head_dims) != 1:
            raise ValueError(
                f"blocks {[m.index for m in members]} have different head_dim {sorted(head_dims)}; only blocks of one "
                "head size can be concatenated."
            )
        wide = self._copy_block(members[0].module)
        view = self.block_view(wide, members[0].index)
        attn = [m.attention for m in members]
        for name in ("q", "k", "v"):
            getattr(view.attention, name).set_(
                torch.cat([getattr(a, name).weight for a in attn]), _cat_biases([getattr(a, name).bias for a in attn])
            )
        view.attention.o.set_(torch.cat([a.o.weight for a in attn], dim=1), _sum_biases([a.o.bias for a in attn]))
        mlp = [m.mlp for m in members]
        view.mlp.up.set_(torch.cat([m.up.weight for m in mlp]), _cat_biases([m.up.bias for m in mlp]))
        view.mlp.down.set_(torch.cat([m.down.weight for m in mlp], dim=1), _sum_biases([m.down.bias for m in mlp]))
        self._sync_sizes(wide)
        return wide

    def keep_heads_(
        self, block: BlockView, kv_head_indices: Sequence[int], o_weight: torch.Tensor | None = None
    ) -> None:
        """Keeps the given heads (ViT has no GQA: every head has its own key and value)."""
        keep_head_rows_(block, kv_head_indices, o_weight)
        self._sync_sizes(block.module)

    @staticmethod
    def _sync_sizes(module: nn.Module) -> None:
        """Keeps ``num_attention_heads`` in line with q_proj (5.23 reshapes with ``head_dim``; 4.x read the head
        count, ``attention_head_size`` and ``all_head_size`` at run time, which is why they must never go stale)."""
        attn = module.attention
        attn.num_attention_heads = attn.q_proj.out_features // attn.head_dim

    def collapsed_stock_config(self) -> dict[str, Any]:
        """``intermediate_size = hidden_size`` and ``hidden_act = "linear"`` (ACT2FN's identity); the export writes
        ``mlp.fc2`` as the identity."""
        return {"intermediate_size": self.config.hidden_size, "hidden_act": "linear"}

    def reindex_(self, stack: str = "encoder") -> None:
        """Nothing to renumber: ViT layers hold no index and no cache."""
        self._check_stack(stack)

    # -------------------------------------------------------------- validating
    def validate(self) -> None:
        layers = self.layers()
        config = self.config
        problems = self.layer_count_problems()
        for i, layer in enumerate(layers):
            view = self.block_view(layer, i)
            g = view.attention.geometry
            if g.num_heads != config.num_attention_heads or layer.attention.num_attention_heads != g.num_heads:
                problems.append(
                    f"layer {i} has {g.num_heads} heads (attribute {layer.attention.num_attention_heads}, "
                    f"config {config.num_attention_heads})"
                )
            if problem := self.mlp_width_problem(view, config.intermediate_size, "intermediate_size"):
                problems.append(problem)
        if problems:
            raise ValueError("compressed model is inconsistent with its config: " + "; ".join(problems))
        self._check_forward()

    @torch.no_grad()
    def _check_forward(self) -> None:
        """One tiny forward on random images runs and gives finite states for CLS + every patch."""
        height, width = _pair(self.config.image_size)
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, self.config.num_channels, height, width, generator=generator)
        pixels = pixels.to(device=input_device(self.model), dtype=model_dtype(self.model))
        base = self.base_model()
        was_training = base.training
        base.eval()
        hidden = base(pixel_values=pixels).last_hidden_state
        base.train(was_training)
        expected = (1, self.num_positions(pixels), self.config.hidden_size)
        if tuple(hidden.shape) != expected or not torch.isfinite(hidden).all():
            raise ValueError(f"the compressed ViT's forward gave states of shape {tuple(hidden.shape)} or NaN/inf.")
