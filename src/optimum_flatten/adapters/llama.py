"""LLaMA-family decoders: LLaMA-2, LLaMA-3 (GQA), SmolLM, Mistral.

Module layout bound here (transformers 5.x, checked on 5.23): ``model.model.layers[i]`` is a decoder layer with
``input_layernorm`` / ``post_attention_layernorm`` (RMSNorm), ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``; query head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)`` (the
``repeat_kv`` layout), and the KV cache is addressed by ``self_attn.layer_idx``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..utils.torch_utils import first_output, input_device, model_dtype
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
from .registry import register_adapter


@register_adapter
class LlamaAdapter(ArchitectureAdapter):
    """Pre-norm decoder with RoPE, RMSNorm and a SwiGLU MLP; q/k/v biases optional (Qwen2 has them)."""

    model_types = ("llama", "mistral")
    capabilities = frozenset({"head_geometry", "gated_mlp", "pre_norm", "concat_heads", "layer_drop"})

    # ----------------------------------------------------------------- reading
    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        return self.base_model().norm

    def qkv_views(self, attn: nn.Module) -> tuple[LinearView, LinearView, LinearView]:
        """The q, k and v projections of an attention module (a family with fused storage overrides this)."""
        return LinearView(attn, "q_proj"), LinearView(attn, "k_proj"), LinearView(attn, "v_proj")

    def block_view(self, module: nn.Module, index: int) -> BlockView:
        attn, mlp = module.self_attn, module.mlp
        head_dim = attn.head_dim
        q, k, v = self.qkv_views(attn)
        geometry = HeadGeometry.of(q, k, head_dim)
        return BlockView(
            index=index,
            module=module,
            norm_position="pre",
            attn_norm=NormView(module.input_layernorm, "rms"),
            mlp_norm=NormView(module.post_attention_layernorm, "rms"),
            attention=AttentionView(
                q=q,
                k=k,
                v=v,
                o=LinearView(attn, "o_proj"),
                geometry=geometry,
                position_scheme="rope",
                module=attn,
            ),
            mlp=MlpView(
                up=LinearView(mlp, "up_proj"),
                gate=LinearView(mlp, "gate_proj"),
                down=LinearView(mlp, "down_proj"),
                activation=mlp.act_fn,
                module=mlp,
            ),
        )

    # ---------------------------------------------------------------- mutating
    def build_concat_block(self, members: Sequence[BlockView]) -> nn.Module:
        require_unit_norms([m.attn_norm for m in members] + [m.mlp_norm for m in members], "attention/MLP")
        head_dims = {m.attention.geometry.head_dim for m in members}
        ratios = {m.attention.geometry.queries_per_kv for m in members}
        if len(head_dims) != 1 or len(ratios) != 1:
            raise ValueError(
                f"blocks {[m.index for m in members]} have different head_dim {sorted(head_dims)} or queries per "
                f"KV head {sorted(ratios)}; only blocks of one head geometry can be concatenated."
            )
        wide = self._copy_block(members[0].module)
        view = self.block_view(wide, members[0].index)
        attn = [m.attention for m in members]
        mlp = [m.mlp for m in members]
        for name in ("q", "k", "v"):
            view_linear: LinearView = getattr(view.attention, name)
            view_linear.set_(
                torch.cat([getattr(a, name).weight for a in attn], dim=0),
                _cat_optional([getattr(a, name).bias for a in attn]),
            )
        view.attention.o.set_(torch.cat([a.o.weight for a in attn], dim=1), _sum_optional([a.o.bias for a in attn]))
        for name in ("gate", "up"):
            getattr(view.mlp, name).set_(
                torch.cat([getattr(m, name).weight for m in mlp], dim=0),
                _cat_optional([getattr(m, name).bias for m in mlp]),
            )
        view.mlp.down.set_(torch.cat([m.down.weight for m in mlp], dim=1), _sum_optional([m.down.bias for m in mlp]))
        self._sync_sizes(wide)
        return wide

    def keep_heads_(
        self, block: BlockView, kv_head_indices: Sequence[int], o_weight: torch.Tensor | None = None
    ) -> None:
        geometry = block.attention.geometry
        kv = sorted(int(i) for i in kv_head_indices)
        if not kv or any(not 0 <= i < geometry.num_kv_heads for i in kv) or len(set(kv)) != len(kv):
            raise ValueError(
                f"kv_head_indices must be unique values in 0..{geometry.num_kv_heads - 1}, got {list(kv_head_indices)}."
            )
        q_rows = torch.tensor(geometry.head_channels(geometry.query_heads_of(kv)))
        kv_rows = torch.tensor(geometry.head_channels(kv))
        att = block.attention
        new_o = att.o.weight[:, q_rows] if o_weight is None else o_weight
        if new_o.shape != (att.o.out_features, q_rows.numel()):
            raise ValueError(
                f"o_weight must be (hidden={att.o.out_features}, kept={q_rows.numel()}), got {tuple(new_o.shape)}."
            )
        att.q.set_(att.q.weight[q_rows], None if att.q.bias is None else att.q.bias[q_rows])
        att.k.set_(att.k.weight[kv_rows], None if att.k.bias is None else att.k.bias[kv_rows])
        att.v.set_(att.v.weight[kv_rows], None if att.v.bias is None else att.v.bias[kv_rows])
        att.o.set_(new_o, att.o.bias)
        self._sync_sizes(block.module)

    @staticmethod
    def _sync_sizes(module: nn.Module) -> None:
        """Keeps the informational size attributes of a resized block in line with its weights."""
        mlp = module.mlp
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = mlp.up_proj.out_features

    def reindex_(self, stack: str = "decoder") -> None:
        for i, layer in enumerate(self.layers(stack)):
            layer.self_attn.layer_idx = i

    # -------------------------------------------------------------- validating
    def validate(self) -> None:
        layers = self.layers()
        problems = self.layer_count_problems()
        for i, layer in enumerate(layers):
            view = self.block_view(layer, i)
            g = view.attention.geometry
            expected_kv = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
            if layer.self_attn.layer_idx != i:
                problems.append(f"layer {i} has layer_idx {layer.self_attn.layer_idx}")
            if g.num_heads != self.config.num_attention_heads or g.num_kv_heads != expected_kv:
                problems.append(f"layer {i} has {g.num_heads} heads / {g.num_kv_heads} KV heads")
            if view.mlp.intermediate_size != self.config.intermediate_size:
                problems.append(f"layer {i} has intermediate size {view.mlp.intermediate_size}")
        if problems:
            raise ValueError("compressed model is inconsistent with its config: " + "; ".join(problems))
        check_cached_forward(self.model)


#: Relative tolerance of the cached-vs-uncached check by parameter dtype (half precision rounds differently along
#: the two paths; a broken cache index is off by far more).
CACHE_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def check_cached_forward(model: nn.Module, atol: float | None = None) -> None:
    """One tiny forward with the KV cache (prefill + 2 decode steps) must match the uncached forward."""
    device = input_device(model)
    atol = CACHE_CHECK_TOLERANCE.get(model_dtype(model), 1e-3) if atol is None else atol
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 6), generator=generator).to(device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        full = first_output(model(ids, use_cache=False).logits)
        out = model(ids[:, :4], use_cache=True)
        steps = [out.logits[:, -1]]
        cache = out.past_key_values
        for t in (4, 5):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    model.train(was_training)
    compare_cached_steps(steps, full, atol, "cached and uncached forwards disagree", "the KV cache indexing is broken.")


def compare_cached_steps(steps: list[torch.Tensor], full: torch.Tensor, atol: float, what: str, cause: str) -> None:
    """Raises ValueError when the outputs of the cached steps (prefill of 4, then one token at a time) differ from
    the uncached forward's at the same positions by more than `atol` times the largest output."""
    cached = torch.stack(steps, dim=1).float()
    reference = full[:, 3:].float()
    scale = reference.abs().max().clamp_min(1.0)
    if not torch.allclose(cached, reference, atol=atol * float(scale), rtol=0):
        diff = (cached - reference).abs().max().item()
        raise ValueError(f"{what} (max |diff| {diff:.3g}): {cause}")


def _cat_optional(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("cannot concatenate blocks where only some members have a bias.")
    return torch.cat(list(tensors), dim=0)


def _sum_optional(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    return torch.stack(present).sum(dim=0)
