"""Baichuan-2 7B (remote code): the LLaMA block behind a fused q/k/v projection and a normalised LM head.

Module layout bound here (the ``modeling_baichuan.py`` shipped with the Baichuan2-7B checkpoints, run through
``trust_remote_code``; checked against transformers 5.23 with our re-implementation in ``tests/tiny_baichuan.py``):
``model.model.layers[i]`` has ``input_layernorm`` / ``post_attention_layernorm`` (RMSNorm whose epsilon is called
``epsilon`` in some revisions and ``variance_epsilon`` in others), ``self_attn.W_pack`` (one bias-free Linear
hidden -> 3 * hidden whose rows are [q; k; v]), ``self_attn.o_proj``, ``self_attn.rotary_emb`` (RoPE with base
10000, hard-coded rather than read from the config) and ``mlp.{gate,up,down}_proj`` (SwiGLU). ``model.lm_head`` is a
``NormHead``: its (vocab, hidden) weight is L2-normalised row-wise before the matmul.

Three remote-code quirks shape this adapter:

* The attention module reads ``self.num_heads`` and ``self.hidden_size`` (as the width of each of q, k and v) at run
  time, so every resize keeps both in line with W_pack (the size attributes of `BAICHUAN_LAYOUT`).
* The decoder layers are called with everything but the hidden state by keyword and return a tuple, which the model
  loop indexes (``layer_outputs[0]``); the KV cache is the legacy tuple of (k, v) per layer, addressed by the
  layer's position in the loop, not by a stored index. `layer_output_is_tuple` tells calibration to make its stand-in
  layers answer with a tuple too.
* ``model_type`` is ``"baichuan"`` for Baichuan-1 and Baichuan-2, 7B and 13B alike, so the family is also chosen by
  ``config.architectures``, and the 13B models (ALiBi instead of RoPE) are refused when the adapter is created.

`export_model` returns an equivalent stock `transformers.LlamaForCausalLM`, so a compressed checkpoint reloads
with plain transformers and no remote code.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..utils.errors import UnsupportedArchitectureError
from .base import PRE_NORM_CAPABILITIES
from .layout import AttentionLayout
from .llama import LLAMA_LAYOUT, LlamaAdapter
from .registry import register_adapter
from .views import BlockView, PackedLinearView

if TYPE_CHECKING:
    from transformers import LlamaConfig

logger = logging.getLogger(__name__)

#: The remote-code class this adapter binds to (lower-case "c"; Baichuan-1 7B is "BaiChuanForCausalLM").
BAICHUAN2_ARCHITECTURE = "BaichuanForCausalLM"

#: Baichuan2-7B's RotaryEmbedding hard-codes ``base=10000`` and its config has no ``rope_theta``.
DEFAULT_ROPE_THETA = 10000.0


#: The LLaMA block with q, k and v fused in ``W_pack`` and no stored layer index (the tuple cache is addressed by the
#: layer's position in the loop). The remote attention reads ``num_heads`` and ``hidden_size`` (the width of each of
#: q, k and v) at run time, so both follow every resize.
BAICHUAN_LAYOUT = dataclasses.replace(
    LLAMA_LAYOUT,
    attention=AttentionLayout(
        fused_qkv="W_pack", layer_idx=None, size_attributes=(("num_heads", "heads"), ("hidden_size", "q_width"))
    ),
)

__all__ = ["BAICHUAN_LAYOUT", "BaichuanAdapter", "PackedLinearView"]


@register_adapter
class BaichuanAdapter(LlamaAdapter):
    """Baichuan-2 7B: the LLaMA adapter's maths over views that hide the fused W_pack and the NormHead.

    Concatenation, head and channel pruning are the LLaMA ones (they only go through views); this class binds the
    remote module names, keeps the remote attention's size attributes in line, and exports to LlamaForCausalLM.

    Raises (at construction, before anything is read or changed):
        UnsupportedArchitectureError: for a ``baichuan`` model that is not ``BaichuanForCausalLM``, or that uses
            ALiBi (Baichuan-13B, Baichuan2-13B).
    """

    model_types = ("baichuan",)
    capabilities = PRE_NORM_CAPABILITIES | {"gated_mlp"}
    # The remote model loop indexes ``layer_outputs[0]``: calibration stand-ins must answer with a tuple too.
    layer_output_is_tuple = True
    layouts = (BAICHUAN_LAYOUT,)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._check_architecture()
        self._refuse_alibi()

    # ------------------------------------------------------------ family checks
    def _check_architecture(self) -> None:
        architectures = list(getattr(self.config, "architectures", None) or [])
        if not architectures:
            # A model built from a config in memory has no `architectures` until it is saved; its class tells.
            architectures = [type(self.model).__name__]
        if BAICHUAN2_ARCHITECTURE not in architectures:
            raise UnsupportedArchitectureError(
                f"BaichuanAdapter serves model_type 'baichuan' with architectures [{BAICHUAN2_ARCHITECTURE!r}] "
                f"(Baichuan-2 remote code), got architectures {architectures}. model_type 'baichuan' is shared by "
                "remote-code families with different layouts (Baichuan-1 7B is 'BaiChuanForCausalLM'); load a "
                "Baichuan-2 checkpoint with trust_remote_code=True, or convert the model to a supported type first."
            )

    def _refuse_alibi(self) -> None:
        """Refuses the 13B models, which use ALiBi position biases instead of RoPE.

        The config alone tells them apart: the 7B config defines ``max_position_embeddings`` (its RoPE table reads
        it) next to ``model_max_length``, while the Baichuan-13B and Baichuan2-13B configs only define
        ``model_max_length``. The 13B base model also has a ``get_alibi_mask`` method, checked as a second sign.
        """
        reasons = []
        if not hasattr(self.config, "max_position_embeddings"):
            reasons.append(
                "its config has no max_position_embeddings (only model_max_length="
                f"{getattr(self.config, 'model_max_length', None)}), as in the 13B configs"
            )
        if hasattr(self._inner_model(), "get_alibi_mask"):
            reasons.append("its base model builds an ALiBi mask (get_alibi_mask)")
        if reasons:
            raise UnsupportedArchitectureError(
                "this Baichuan model uses ALiBi position biases (Baichuan-13B / Baichuan2-13B): "
                + "; ".join(reasons)
                + ". No stock transformers architecture with RMSNorm and a SwiGLU MLP supports ALiBi, so a "
                "compressed 13B model could not be saved as a plain checkpoint. Only the RoPE models "
                "(Baichuan2-7B) are supported; use Baichuan2-7B, or a LLaMA-family model."
            )

    # ----------------------------------------------------------------- reading
    def _inner_model(self) -> nn.Module:
        """The remote ``BaichuanModel`` (``model.model``): embeddings, layers and final norm."""
        return self._root()

    def embeddings(self) -> nn.Module:
        return self._inner_model().embed_tokens

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """The ``NormHead``; its `weight` is the raw parameter, normalised row-wise at inference (see export)."""
        return self.model.lm_head

    # --------------------------------------------------------------- exporting
    def export_model(self) -> nn.Module:
        """An equivalent stock `LlamaForCausalLM`, so the saved checkpoint loads without remote code.

        W_pack is split into q/k/v_proj, the norms keep their epsilon, the NormHead's row normalisation is baked into
        ``lm_head.weight`` (so the head no longer needs to normalise), and the embeddings stay untied. Unchanged
        tensors are shared with this model, not copied; the q/k/v slices and the normalised head are new tensors.

        Raises:
            ValueError: when the layers differ in head count, head size or MLP width (LLaMA has one of each), carry
                biases, or use different norm epsilons.
            UnsupportedArchitectureError: when the rotary frequencies are not plain RoPE with one base.
        """
        from transformers import LlamaForCausalLM

        blocks = self.blocks()
        num_heads, head_dim, intermediate_size = self._llama_shape(blocks)
        llama_config = self._llama_config(blocks, num_heads, head_dim, intermediate_size)
        # Built on the meta device so no weights are allocated or randomly initialised, then given the tensors.
        with torch.device("meta"):
            exported = LlamaForCausalLM(llama_config)
        exported.load_state_dict(_unshared(self._llama_state(blocks)), strict=True, assign=True)
        # The rotary frequencies are a non-persistent buffer (not in the state dict): rebuild them for real.
        device = self.embeddings().weight.device
        exported.model.rotary_emb = type(exported.model.rotary_emb)(config=exported.config).to(device)
        left_on_meta = [n for n, t in [*exported.named_parameters(), *exported.named_buffers()] if t.is_meta]
        if left_on_meta:
            raise RuntimeError(f"LLaMA export left tensors without data: {left_on_meta}.")
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            exported.generation_config = copy.deepcopy(generation_config)
        exported.train(self.model.training)
        logger.info(
            "exported Baichuan model as LlamaForCausalLM: %d layers, %d heads of %d, MLP width %d",
            len(blocks),
            num_heads,
            head_dim,
            intermediate_size,
        )
        return exported

    @staticmethod
    def _llama_shape(blocks: list[BlockView]) -> tuple[int, int, int]:
        """(heads, head_dim, MLP width), the one shape every layer must share for LLaMA, whose projections must also
        carry no bias (LLaMA's config has one of each and ``attention_bias=mlp_bias=False`` would drop a bias)."""
        shapes = {
            (b.attention.geometry.num_heads, b.attention.geometry.head_dim, b.mlp.intermediate_size) for b in blocks
        }
        if len(shapes) != 1:
            raise ValueError(
                f"export to LlamaForCausalLM needs every layer to have the same (heads, head_dim, intermediate size), "
                f"got {sorted(shapes)}; LLaMA has one of each. Compress to a uniform shape first."
            )
        biased = sorted(
            {
                name
                for b in blocks
                for name, view in (
                    ("W_pack", b.attention.q),
                    ("o_proj", b.attention.o),
                    ("gate_proj", b.mlp.gate),
                    ("up_proj", b.mlp.up),
                    ("down_proj", b.mlp.down),
                )
                if view is not None and view.module.bias is not None
            }
        )
        if biased:
            raise ValueError(
                f"Baichuan's projections have no biases, but {biased} carry one; the LLaMA export (attention_bias="
                "False, mlp_bias=False) would drop it. Export a model whose projections have no bias."
            )
        return shapes.pop()

    def _llama_config(
        self, blocks: list[BlockView], num_heads: int, head_dim: int, intermediate_size: int
    ) -> LlamaConfig:
        """The `LlamaConfig` of the export: this model's sizes and token ids, plain RoPE, one norm epsilon (refused
        when the norms differ), untied embeddings."""
        from transformers import LlamaConfig

        norms = [m for b in blocks for m in (b.attn_norm.module, b.mlp_norm.module)] + [self._inner_model().norm]
        epsilons = {self._norm_epsilon(m) for m in norms}
        if len(epsilons) != 1:
            raise ValueError(f"the RMSNorms use different epsilons {sorted(epsilons)}; LLaMA has one rms_norm_eps.")
        embed = self.embeddings()
        return LlamaConfig(
            vocab_size=embed.weight.shape[0],
            hidden_size=embed.weight.shape[1],
            intermediate_size=intermediate_size,
            num_hidden_layers=len(blocks),
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            head_dim=head_dim,
            hidden_act=getattr(self.config, "hidden_act", "silu"),
            max_position_embeddings=self.config.max_position_embeddings,
            initializer_range=getattr(self.config, "initializer_range", 0.02),
            rms_norm_eps=epsilons.pop(),
            rope_parameters={"rope_type": "default", "rope_theta": self._rope_theta(head_dim)},
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            pad_token_id=getattr(self.config, "pad_token_id", None),
            bos_token_id=getattr(self.config, "bos_token_id", None),
            eos_token_id=getattr(self.config, "eos_token_id", None),
            dtype=embed.weight.dtype,
        )

    def _llama_state(self, blocks: list[BlockView]) -> dict[str, torch.Tensor]:
        """The export's state dict under LLaMA's names: W_pack's q/k/v slices copied (safetensors refuses tensors
        that share storage), the head normalised (`_effective_head_weight`), every other tensor shared."""
        state = {
            "model.embed_tokens.weight": self.embeddings().weight.detach(),
            "model.norm.weight": self._inner_model().norm.weight.detach(),
            "lm_head.weight": self._effective_head_weight(),
        }
        for i, block in enumerate(blocks):
            prefix = f"model.layers.{i}."
            att, mlp = block.attention, block.mlp
            state[prefix + "input_layernorm.weight"] = block.attn_norm.weight.detach()
            state[prefix + "post_attention_layernorm.weight"] = block.mlp_norm.weight.detach()
            for name, view in (("q_proj", att.q), ("k_proj", att.k), ("v_proj", att.v)):
                state[prefix + f"self_attn.{name}.weight"] = view.weight.detach().clone()
            state[prefix + "self_attn.o_proj.weight"] = att.o.weight.detach()
            for name, view in (("gate_proj", mlp.gate), ("up_proj", mlp.up), ("down_proj", mlp.down)):
                state[prefix + f"mlp.{name}.weight"] = view.weight.detach()
        return state

    def _effective_head_weight(self) -> torch.Tensor:
        """The matrix the head really multiplies by: NormHead normalises each vocabulary row to unit L2 norm.

        The remote NormHead also overwrites its weight with the normalised one on its first eval forward; normalising
        again is then a no-op, so the result does not depend on whether the model has run yet.
        """
        head = self.lm_head()
        weight = head.weight.detach()
        if isinstance(head, nn.Linear):  # a plain head (e.g. a converted model) multiplies by its weight as is
            return weight
        return F.normalize(weight.float(), dim=-1).to(weight.dtype)

    def _norm_epsilon(self, norm: nn.Module) -> float:
        # Baichuan2-13B's RMSNorm calls it `epsilon`, other revisions `variance_epsilon`; `eps` is torch's name.
        for name in ("epsilon", "variance_epsilon", "eps"):
            value = getattr(norm, name, None)
            if isinstance(value, (int, float)):
                return float(value)
        return float(self.config.rms_norm_eps)

    def _rope_theta(self, head_dim: int) -> float:
        """The RoPE base, checked against the rotary frequencies the layers really use when they expose them."""
        theta = float(getattr(self.config, "rope_theta", None) or DEFAULT_ROPE_THETA)
        expected = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        for i, layer in enumerate(self.layers()):
            inv_freq = getattr(getattr(layer.self_attn, "rotary_emb", None), "inv_freq", None)
            if not isinstance(inv_freq, torch.Tensor) or inv_freq.is_meta:
                continue
            if inv_freq.shape != expected.shape or not torch.allclose(
                inv_freq.double().cpu(), expected, rtol=1e-5, atol=0
            ):
                raise UnsupportedArchitectureError(
                    f"layer {i}'s rotary frequencies are not plain RoPE with base {theta:g} over head_dim {head_dim} "
                    f"(got {inv_freq.numel()} frequencies starting {inv_freq.flatten()[:3].tolist()}); the LLaMA "
                    "export would change the outputs. Set config.rope_theta to the base the model uses."
                )
        return theta


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a tensor that shares its storage with an earlier one copied: a method that ties layers' weights
    (ffn_merge) leaves one storage under several LLaMA names, which ``save_pretrained`` refuses outside the model's
    declared ties; a stock LLaMA checkpoint stores each in full anyway."""
    seen: set[int] = set()
    unshared = {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return unshared
