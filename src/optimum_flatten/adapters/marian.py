"""Marian (OPUS-MT) encoder-decoder translation models: ``MarianMTModel`` and a bare ``MarianModel``.

Module layout bound here (transformers 5.x, checked on 5.23, ``models/marian/modeling_marian.py``):

* ``model.model`` is a ``MarianModel`` (for a bare ``MarianModel`` the model itself) with ``encoder.layers[i]``
  (``MarianEncoderLayer``) and ``decoder.layers[i]`` (``MarianDecoderLayer``). Every block holds ``self_attn``
  (``MarianAttention``: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, all with bias, full multi-head attention),
  ``self_attn_layer_norm``, ``fc1`` -> ``activation_fn`` -> ``fc2`` (not gated) and ``final_layer_norm``; a decoder
  block adds ``encoder_attn`` (cross-attention over the encoder's output) and ``encoder_attn_layer_norm``.
* Every block is **post-LN** whatever the config says: 5.23's layers always compute ``norm(x + sublayer(x))``.
  ``MarianConfig`` has no ``normalize_before`` key (Marian-native configs do; the conversion script refuses
  ``normalize-before: true``), so a config carrying ``normalize_before=True`` would describe a pre-LN checkpoint the
  transformers code does not compute: the adapter refuses it rather than compress a model that computes something
  else than it was trained for.
* Neither stack ends in a LayerNorm: 5.23's ``MarianEncoder`` / ``MarianDecoder`` have no ``layer_norm`` and no
  ``layernorm_embedding`` (unlike mBART). Positions are sinusoidal, added to the scaled token embeddings.
* The MT head is ``lm_head(h) + final_logits_bias`` (a buffer), tied to ``model.shared`` in OPUS-MT checkpoints.
* Only decoder layers take a ``layer_idx`` (both ``self_attn`` and ``encoder_attn`` carry it): the decoder builds an
  ``EncoderDecoderCache(DynamicCache, DynamicCache)`` whose self- and cross-attention parts are addressed by it,
  and whose ``is_updated`` flags (cross-attention keys computed once) are keyed by it. The caches are sized from
  ``config.get_text_config(decoder=True)``, which maps ``decoder_layers`` to ``num_hidden_layers``. Encoder layers are
  built without an index (``None``) and never touch a cache.
* ``MarianConfig.attribute_map`` makes ``num_hidden_layers`` an alias of ``encoder_layers`` (and
  ``num_attention_heads`` of ``encoder_attention_heads``): the layer counts are ``encoder_layers`` and
  ``decoder_layers``, nothing else.
* ``MarianDecoder.forward`` calls each layer with ``(hidden, causal_mask, encoder_hidden_states, ...)``: the mask and
  the encoder states are positional; the calibration recorder names them through the layer's signature.

``MarianForCausalLM`` (model_type "marian" too, a decoder without an encoder) is not bound and is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from ..utils.cache import cache_keyword, returned_cache
from ..utils.errors import UnsupportedArchitectureError
from ..utils.torch_utils import first_output, input_device, model_dtype
from .base import ArchitectureAdapter
from .checks import CACHE_CHECK_TOLERANCE, compare_cached_steps
from .layout import AttentionLayout, BlockLayout, MlpLayout
from .post_ln import post_ln_reasons
from .registry import register_adapter
from .views import BlockView, NormView

#: An encoder block: MarianAttention reshapes with ``head_dim`` only (5.23), ``num_heads`` is informational; encoder
#: layers are built without a cache index. A parameter merge combines the attentions and fc1/fc2 (the derived
#: prefixes ``self_attn.``, ``encoder_attn.``, ``fc1.``, ``fc2.``: their trailing dots keep ``self_attn.`` from matching
#: ``self_attn_layer_norm.``); the three LayerNorms stay the first member's.
MARIAN_ENCODER_LAYOUT = BlockLayout(
    stack="encoder",
    layers="encoder.layers",
    attention=AttentionLayout(
        o="out_proj",
        layer_idx=None,
        position_scheme="sinusoidal",
        size_attributes=(("num_heads", "heads"),),
        heads_key="encoder_attention_heads",
    ),
    mlp=MlpLayout(
        path="",
        up="fc1",
        gate=None,
        down="fc2",
        activation="activation_fn",
        width_key="encoder_ffn_dim",
        activation_key="activation_function",
    ),
    attn_norm="self_attn_layer_norm",
    mlp_norm="final_layer_norm",
    norm_kind="layer",
    norm_position="post",
    final_norm=None,
    lm_head=False,
    layer_count_key="encoder_layers",
)
_DECODER_ATTENTION = dataclasses.replace(
    MARIAN_ENCODER_LAYOUT.attention, layer_idx="layer_idx", heads_key="decoder_attention_heads"
)
#: A decoder block adds the cross-attention ``encoder_attn``; both attentions carry the EncoderDecoderCache index.
MARIAN_DECODER_LAYOUT = dataclasses.replace(
    MARIAN_ENCODER_LAYOUT,
    stack="decoder",
    layers="decoder.layers",
    attention=_DECODER_ATTENTION,
    cross_attention=dataclasses.replace(_DECODER_ATTENTION, path="encoder_attn"),
    mlp=dataclasses.replace(MARIAN_ENCODER_LAYOUT.mlp, width_key="decoder_ffn_dim"),
    lm_head=True,
    layer_count_key="decoder_layers",
)


def teacher_forcing_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_start_token_id: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs and mask for calibrating on a single text column (the source text is also the target).

    The target is the text after its first token, ``y = input_ids[:, 1:]``, and the decoder reads it shifted right
    behind the decoder start token (BART's ``shift_tokens_right``), one position longer so that the decoder sequence
    has the source's length: ``[start, x1, ..., x_{n-1}]``. Decoder state ``t`` then predicts ``x_{t+1}``, the same
    next-token alignment as a decoder-only LM on ``input_ids``: every method's statistics (token masks, SLEB's NLL
    over ``input_ids``) carry over unchanged, and position 0 holds the start token the decoder always sees in
    training and generation.

    Args:
        input_ids: (batch, n) calibration tokens (right-padded or packed).
        attention_mask: (batch, n), 1 on real tokens.
        decoder_start_token_id: ``config.decoder_start_token_id`` (the pad token in OPUS-MT).
        pad_token_id: Written on padded positions (-100 label values included, as shift_tokens_right does).

    Returns:
        ``(decoder_input_ids, decoder_attention_mask)``, both (batch, n).
    """
    if decoder_start_token_id is None or pad_token_id is None:
        raise ValueError(
            f"teacher forcing needs config.decoder_start_token_id and config.pad_token_id, got "
            f"{decoder_start_token_id!r} and {pad_token_id!r}; set them in the model config."
        )
    target = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, pad_token_id)
    target = target.masked_fill(target == -100, pad_token_id)
    start = torch.full_like(input_ids[:, :1], decoder_start_token_id)
    decoder_input_ids = torch.cat([start, target], dim=1)
    decoder_mask = torch.cat([torch.ones_like(attention_mask[:, :1]), attention_mask[:, 1:]], dim=1)
    return decoder_input_ids, decoder_mask


class MarianLogitsHead(nn.Module):
    """The MT head as ``MarianMTModel.forward`` applies it: ``lm_head(h) + final_logits_bias``.

    The bias is a per-token offset of the logits, so any loss computed from ``lm_head`` alone would differ from the
    model's; this wrapper holds references to the model's own modules (it owns no tensor).
    """

    def __init__(self, linear: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("final_logits_bias", bias, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden) + self.final_logits_bias.to(hidden.device)


@register_adapter
class MarianAdapter(ArchitectureAdapter):
    """Two post-LN stacks ("encoder", "decoder") with full multi-head attention and a plain fc1/fc2 MLP.

    Whole blocks can be dropped or merged by parameters; the norm-folding and head concatenation of FlattenGPT
    need pre-norm blocks and are refused (see `missing_capability_reasons`).

    Raises:
        UnsupportedArchitectureError: for ``MarianForCausalLM`` (no encoder) and for a config saying
            ``normalize_before=True`` (see the module docstring).
    """

    model_types = ("marian",)
    layouts = (MARIAN_ENCODER_LAYOUT, MARIAN_DECODER_LAYOUT)
    capabilities = frozenset({"head_geometry", "layer_drop", "parameter_merge", "dense_mlp"})
    missing_capability_reasons: ClassVar[dict[str, str]] = post_ln_reasons("Marian", "fc1 -> activation -> fc2")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        seq2seq = self._seq2seq_or_none()
        if seq2seq is None:
            raise UnsupportedArchitectureError(
                f"MarianAdapter serves encoder-decoder Marian models (MarianMTModel, MarianModel), got "
                f"{type(model).__name__}, which has no encoder. Load the checkpoint with MarianMTModel."
            )
        if getattr(self.config, "normalize_before", False):
            raise UnsupportedArchitectureError(
                "the Marian config says normalize_before=True (pre-LN blocks), got a config with it set, but "
                "transformers' Marian layers always compute post-LN (checked on 5.23), so this model does not compute "
                "what its checkpoint was trained for. Use a checkpoint converted with normalize_before=False."
            )

    # ----------------------------------------------------------------- reading
    def _seq2seq_or_none(self) -> nn.Module | None:
        for candidate in (getattr(self.model, "model", None), self.model):
            if isinstance(candidate, nn.Module) and hasattr(candidate, "encoder") and hasattr(candidate, "decoder"):
                return candidate
        return None

    def seq2seq(self) -> nn.Module:
        """The ``MarianModel`` (encoder + decoder, no head)."""
        return self._seq2seq_or_none()

    def base_model(self, stack: str = "decoder") -> nn.Module:
        """What calibration runs: the encoder alone for "encoder" (the forward never reaches the decoder), the whole
        ``MarianModel`` for "decoder" (the encoder runs fully, its output feeds every decoder layer)."""
        self._check_stack(stack)
        return self.seq2seq().encoder if stack == "encoder" else self.seq2seq()

    def final_norm(self, stack: str | None = None) -> nn.Module | None:
        """Marian's stacks end without a norm (transformers 5.23): an identity, so callers may apply it blindly.

        The stack argument (None: the decoder) is checked only: both stacks answer the same.
        """
        self._check_stack(stack or "decoder")
        return nn.Identity()

    def lm_head(self, stack: str | None = None) -> nn.Module | None:
        """The MT head (`MarianLogitsHead`, with ``final_logits_bias``) for the decoder; None for the encoder, whose
        states no head reads, and for a bare ``MarianModel``."""
        stack = stack or "decoder"
        self._check_stack(stack)
        linear = self.model.get_output_embeddings()
        if stack != "decoder" or linear is None:
            return None
        return MarianLogitsHead(linear, self.model.final_logits_bias)

    def position_embeddings(self, stack: str = "decoder") -> nn.Module:
        """The stack's fixed sinusoidal position table (``embed_positions``)."""
        return self._root(stack).get_submodule(stack).embed_positions

    def cross_attn_norm(self, block: BlockView) -> NormView | None:
        """The LayerNorm after the cross-attention residual add (``encoder_attn_layer_norm``), None in the encoder.

        BlockView has fields for the self-attention and MLP norms only; this is where the third one is read.
        """
        norm = getattr(block.module, "encoder_attn_layer_norm", None)
        return None if norm is None else NormView(norm, "layer")

    # ------------------------------------------------------------- calibration
    def forward_inputs(self, stack: str, batch: Any, device: torch.device) -> dict[str, Any]:
        """Encoder: the source tokens only. Decoder: the source tokens plus teacher-forced decoder inputs.

        The calibration data has one text column, so the text is also the target (`teacher_forcing_inputs`): the
        decoder is calibrated on its states while it reproduces the source. That is the only target available; for
        real translation pairs, a parallel corpus would have to come through a target column in calibration/data.py.
        """
        self._check_stack(stack)
        inputs: dict[str, Any] = {
            "input_ids": batch.input_ids.to(device),
            "attention_mask": batch.attention_mask.to(device),
        }
        if stack == "decoder":
            decoder_ids, decoder_mask = self.decoder_inputs(batch)
            inputs.update(
                decoder_input_ids=decoder_ids.to(device),
                decoder_attention_mask=decoder_mask.to(device),
                use_cache=False,
            )
        return inputs

    def decoder_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """What calibration feeds the decoder for `batch` (see `teacher_forcing_inputs`)."""
        return teacher_forcing_inputs(
            batch.input_ids, batch.attention_mask, self.config.decoder_start_token_id, self.config.pad_token_id
        )

    def token_mask(self, stack: str, batch: Any) -> torch.Tensor:
        """The source mask for the encoder, the decoder-input mask (start token real) for the decoder."""
        self._check_stack(stack)
        return batch.attention_mask if stack == "encoder" else self.decoder_inputs(batch)[1]

    # -------------------------------------------------------------- validating
    def check_forward(self) -> None:
        """Cached decoding matches uncached decoding (a wrong decoder ``layer_idx`` reads another layer's cache)."""
        check_cached_seq2seq_forward(self.model)


def _decoder_output(model: nn.Module, **inputs: Any) -> Any:
    """Logits of an MT model, the decoder's last hidden state of a bare MarianModel."""
    out = model(**inputs)
    return out, first_output(out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state)


def check_cached_seq2seq_forward(model: nn.Module, atol: float | None = None) -> None:
    """Decoding with the EncoderDecoderCache (prefill 4 target tokens, then 2 single steps) matches one uncached pass.

    A decoder layer whose ``layer_idx`` is wrong reads another layer's self- or cross-attention keys (or finds its
    cross-attention flagged as already computed), so the outputs of the cached steps differ.
    """
    device = input_device(model)
    atol = CACHE_CHECK_TOLERANCE.get(model_dtype(model), 1e-3) if atol is None else atol
    config = model.config
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(3, config.vocab_size, (1, 5), generator=generator).to(device)
    target = torch.randint(3, config.vocab_size, (1, 6), generator=generator).to(device)
    target[:, 0] = config.decoder_start_token_id
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, full = _decoder_output(model, input_ids=source, decoder_input_ids=target, use_cache=False)
            steps = _cached_steps(model, source, target)
    except (RuntimeError, IndexError) as error:
        # A layer reading another layer's cache slot (of another length) fails before any comparison.
        raise ValueError(
            f"cached decoding failed ({type(error).__name__}: {error}): the decoder's layer_idx (the "
            "EncoderDecoderCache index) is broken; call reindex_('decoder')."
        ) from error
    finally:
        model.train(was_training)
    compare_cached_steps(
        steps,
        full,
        atol,
        "cached and uncached decoding disagree",
        "the decoder's layer_idx (the EncoderDecoderCache index) is broken; call reindex_('decoder').",
    )


def _cached_steps(model: nn.Module, source: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    """Outputs at target positions 3, 4 and 5: a prefill of 4 tokens, then two single cached steps."""
    encoder_outputs = model.get_encoder()(input_ids=source)
    out, step = _decoder_output(model, encoder_outputs=encoder_outputs, decoder_input_ids=target[:, :4], use_cache=True)
    steps = [step[:, -1]]
    for t in (4, 5):
        out, step = _decoder_output(
            model,
            encoder_outputs=encoder_outputs,
            decoder_input_ids=target[:, t : t + 1],
            use_cache=True,
            **{cache_keyword(model): returned_cache(out)},
        )
        steps.append(step[:, -1])
    return steps
