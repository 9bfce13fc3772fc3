"""A small re-implementation of Baichuan-2's remote modelling code, so the Baichuan adapter is tested offline.

Baichuan ships its model class with the checkpoints (``trust_remote_code``), which tests cannot fetch. This module
rebuilds what the adapter binds to, with the remote module names, call conventions and numerics:

* 7B (RoPE): ``model.model.{embed_tokens, layers, norm}``; each layer has ``input_layernorm`` /
  ``post_attention_layernorm`` (RMSNorm with ``weight`` and ``epsilon``), ``self_attn.W_pack`` (hidden -> 3 x hidden,
  rows [q; k; v], no bias), ``self_attn.o_proj``, ``self_attn.rotary_emb`` (base 10000, hard-coded as upstream) and
  ``mlp.{gate,up,down}_proj`` (SwiGLU). The attention reads ``self.num_heads`` and ``self.hidden_size`` at run time.
  Layers get ``(hidden_states, attention_mask=, position_ids=, past_key_value=, output_attentions=, use_cache=)``
  and return a tuple; the cache is the legacy tuple of (k, v) per layer. ``model.lm_head`` is a ``NormHead``
  (rows L2-normalised; on its first eval forward it overwrites its weight with the normalised one, as upstream).
* 13B (ALiBi): the same blocks without rotary embeddings and without ``position_ids``; the base model adds ALiBi
  biases to the mask (``get_alibi_mask``), and the config has ``model_max_length`` but no
  ``max_position_embeddings``. Only used to check that the adapter refuses it.

Deliberate simplifications: no xformers / training-time paths, no gradient checkpointing, no 4-bit loading, no
chat helpers, and the additive mask is clamped at the dtype minimum (upstream can sum two minima to -inf, which
only matters for fully padded rows).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


# --------------------------------------------------------------------------------------------------- configs
class BaichuanConfig(PretrainedConfig):
    """Baichuan2-7B's config: ``max_position_embeddings`` (read by the RoPE table) next to ``model_max_length``."""

    model_type = "baichuan"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 96,
        hidden_size: int = 32,
        intermediate_size: int = 48,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 4,
        hidden_act: str = "silu",
        max_position_embeddings: int = 128,
        model_max_length: int = 128,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        z_loss_weight: float = 0.0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.model_max_length = model_max_length
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.z_loss_weight = z_loss_weight
        kwargs.setdefault("architectures", ["BaichuanForCausalLM"])
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


class Baichuan13BConfig(PretrainedConfig):
    """Baichuan(2)-13B's config: ``model_max_length`` only, since ALiBi needs no position table."""

    model_type = "baichuan"

    def __init__(
        self,
        vocab_size: int = 96,
        hidden_size: int = 32,
        intermediate_size: int = 48,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        hidden_act: str = "silu",
        model_max_length: int = 128,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.model_max_length = model_max_length
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["BaichuanForCausalLM"])
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


# ---------------------------------------------------------------------------------------------- shared parts
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.epsilon = epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class NormHead(nn.Module):
    """LM head whose vocabulary rows are L2-normalised before the matmul."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((vocab_size, hidden_size)))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.first_flag = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training:
            norm_weight = F.normalize(self.weight)
            self.first_flag = True
        elif self.first_flag:
            # Upstream normalises the stored weight in place on the first eval call, then reuses it.
            self.first_flag = False
            self.weight.data = F.normalize(self.weight)
            norm_weight = self.weight
        else:
            norm_weight = self.weight
        return F.linear(hidden_states, norm_weight)


def _split_w_pack(attn: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as (batch, heads, seq, head_dim), split with the attention's run-time size attributes."""
    bsz, q_len, _ = hidden_states.shape
    proj = attn.W_pack(hidden_states).unflatten(-1, (3, attn.hidden_size))
    return tuple(proj[..., i, :].view(bsz, q_len, attn.num_heads, attn.head_dim).transpose(1, 2) for i in range(3))


def _neg_min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


# ------------------------------------------------------------------------------------------------- 7B (RoPE)
class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, max_position_embeddings: int = 2048, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cache(max_position_embeddings)

    def _set_cache(self, seq_len: int) -> None:
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len_cached:
            self._set_cache(seq_len)
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    q_embed = q.float() * cos + rotate_half(q.float()) * sin
    k_embed = k.float() * cos + rotate_half(k.float()) * sin
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


class Attention(nn.Module):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ):
        bsz, q_len, _ = hidden_states.shape
        query, key, value = _split_w_pack(self, hidden_states)
        kv_seq_len = key.shape[-2] + (0 if past_key_value is None else past_key_value[0].shape[-2])
        cos, sin = self.rotary_emb(value, seq_len=kv_seq_len)
        query, key = apply_rotary_pos_emb(query, key, cos, sin, position_ids)
        if past_key_value is not None:
            key = torch.cat([past_key_value[0], key], dim=2)
            value = torch.cat([past_key_value[1], value], dim=2)
        present = (key, value) if use_cache else None
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        output = output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(output), None, present


class DecoderLayer(nn.Module):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ) -> tuple:
        residual = hidden_states
        hidden_states, attn_weights, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        outputs: tuple = (hidden_states,)
        if output_attentions:
            outputs += (attn_weights,)
        if use_cache:
            outputs += (present,)
        return outputs


class BaichuanPreTrainedModel(PreTrainedModel):
    config_class = BaichuanConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


def _causal_mask(bsz: int, tgt_len: int, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.full((tgt_len, tgt_len), _neg_min(dtype), device=device).triu(1)
    mask = torch.cat([torch.zeros(tgt_len, past_len, dtype=dtype, device=device), mask.to(dtype)], dim=-1)
    return mask[None, None].expand(bsz, 1, tgt_len, tgt_len + past_len)


def _padding_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int) -> torch.Tensor:
    bsz, src_len = mask.shape
    inverted = 1.0 - mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    return inverted.masked_fill(inverted.to(torch.bool), _neg_min(dtype))


class BaichuanModel(BaichuanPreTrainedModel):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = False,
        output_hidden_states: bool | None = False,
        return_dict: bool | None = True,
    ) -> BaseModelOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len, _ = inputs_embeds.shape
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        device, dtype = inputs_embeds.device, inputs_embeds.dtype
        if position_ids is None:
            # Upstream counts positions from the cache length, ignoring padding.
            position_ids = torch.arange(past_len, past_len + seq_len, device=device).unsqueeze(0)
        if attention_mask is None:
            attention_mask = torch.ones((bsz, past_len + seq_len), dtype=torch.bool, device=device)
        mask = _padding_mask(attention_mask, dtype, seq_len)
        if seq_len > 1:
            mask = mask + _causal_mask(bsz, seq_len, past_len, dtype, device)
        mask = mask.clamp_min(_neg_min(dtype))
        hidden_states = inputs_embeds
        all_hidden: tuple | None = () if output_hidden_states else None
        next_cache: tuple | None = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            if all_hidden is not None:
                all_hidden += (hidden_states,)
            outputs = layer(
                hidden_states,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_value=None if past_key_values is None else past_key_values[idx],
                output_attentions=output_attentions,
                use_cache=use_cache,
            )
            hidden_states = outputs[0]
            if next_cache is not None:
                next_cache += (outputs[2 if output_attentions else 1],)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden += (hidden_states,)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=next_cache, hidden_states=all_hidden
        )


class BaichuanForCausalLM(BaichuanPreTrainedModel):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__(config)
        self.model = BaichuanModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = False,
        output_hidden_states: bool | None = False,
        return_dict: bool | None = True,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states
        )


# ----------------------------------------------------------------------------------------------- 13B (ALiBi)
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slopes (geometric per head; interleaved for a head count that is not a power of two)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(power_of_2(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = alibi_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.cat([torch.tensor(power_of_2(closest)), extra])


class AlibiAttention(nn.Module):
    def __init__(self, config: Baichuan13BConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.max_position_embeddings = config.model_max_length
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ):
        bsz, q_len, _ = hidden_states.shape
        query, key, value = _split_w_pack(self, hidden_states)
        if past_key_value is not None:
            key = torch.cat([past_key_value[0], key], dim=2)
            value = torch.cat([past_key_value[1], value], dim=2)
        present = (key, value) if use_cache else None
        scores = query @ key.transpose(2, 3) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = torch.maximum(scores + attention_mask[..., -q_len:, :], torch.tensor(_neg_min(scores.dtype)))
        output = scores.softmax(dim=-1) @ value
        output = output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(output), None, present


class BaichuanLayer(nn.Module):
    def __init__(self, config: Baichuan13BConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = AlibiAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ) -> tuple:
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states, present) if use_cache else (hidden_states,)


class Baichuan13BPreTrainedModel(BaichuanPreTrainedModel):
    config_class = Baichuan13BConfig
    _no_split_modules: ClassVar[list[str]] = ["BaichuanLayer"]


class Baichuan13BModel(Baichuan13BPreTrainedModel):
    def __init__(self, config: Baichuan13BConfig) -> None:
        super().__init__(config)
        self.n_head = config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([BaichuanLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_alibi_mask(self, tensor: torch.Tensor, seq_length_with_past: int) -> torch.Tensor:
        """(heads, L, L): causal mask plus slope x (key position - query position)."""
        positions = torch.arange(seq_length_with_past, device=tensor.device)
        distance = (positions[None, :] - positions[:, None]).to(tensor.dtype)
        slopes = alibi_slopes(self.n_head).to(device=tensor.device, dtype=tensor.dtype)
        causal = torch.full_like(distance, _neg_min(tensor.dtype)).triu(1)
        return slopes[:, None, None] * distance[None] + causal[None]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        output_hidden_states: bool | None = False,
        return_dict: bool | None = True,
    ) -> BaseModelOutputWithPast:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        seq_len = inputs_embeds.shape[1]
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        mask = self.get_alibi_mask(inputs_embeds, past_len + seq_len)[None]
        if attention_mask is not None:
            mask = (mask + _padding_mask(attention_mask, inputs_embeds.dtype, past_len + seq_len)).clamp_min(
                _neg_min(inputs_embeds.dtype)
            )
        hidden_states = inputs_embeds
        next_cache: tuple | None = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            outputs = layer(
                hidden_states,
                attention_mask=mask,
                past_key_value=None if past_key_values is None else past_key_values[idx],
                output_attentions=output_attentions,
                use_cache=use_cache,
            )
            hidden_states = outputs[0]
            if next_cache is not None:
                next_cache += (outputs[1],)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=next_cache)


class Baichuan13BForCausalLM(Baichuan13BPreTrainedModel):
    def __init__(self, config: Baichuan13BConfig) -> None:
        super().__init__(config)
        self.model = Baichuan13BModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool | None = False,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache
        )
        logits = self.lm_head(outputs.last_hidden_state)
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)


# ------------------------------------------------------------------------------------------------- factories
def _randomise_norms_(model: nn.Module, seed: int) -> None:
    """Random norm gains (as in tiny_models), so that folding and concatenation are really exercised."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm.weight" in name:
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))


def _vocab_size() -> int:
    # Imported here, not at module level: tiny_models imports this module for its factory table.
    from tiny_models import VOCAB

    return VOCAB


def tiny_baichuan(seed: int = 0, **overrides: Any) -> BaichuanForCausalLM:
    """Baichuan2-7B-style model (RoPE, W_pack, NormHead): 6 layers, 4 heads of 8, float32, eval mode."""
    torch.manual_seed(seed)
    model = BaichuanForCausalLM(BaichuanConfig(vocab_size=_vocab_size(), **overrides)).float()
    _randomise_norms_(model, seed)
    return model.eval()


def tiny_baichuan_13b(seed: int = 0, **overrides: Any) -> Baichuan13BForCausalLM:
    """Baichuan2-13B-style model (ALiBi, no max_position_embeddings in the config): the adapter must refuse it."""
    torch.manual_seed(seed)
    model = Baichuan13BForCausalLM(Baichuan13BConfig(vocab_size=_vocab_size(), **overrides)).float()
    _randomise_norms_(model, seed)
    return model.eval()
