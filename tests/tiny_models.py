"""Seeded tiny random models, one factory per architecture family (float32, CPU, no downloads)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from tiny_baichuan import tiny_baichuan

VOCAB = 96


def _build(config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norm gains and biases so that folding and concatenation are really exercised.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm.weight" in name:
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.eval()
    return model


def _common(**overrides):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    base.update(overrides)
    return base


def tiny_llama_mha(seed: int = 0):
    return _build(LlamaConfig(**_common()), seed)


def tiny_llama_gqa(seed: int = 0):
    return _build(LlamaConfig(**_common(num_key_value_heads=2)), seed)


def tiny_mistral(seed: int = 0):
    return _build(MistralConfig(**_common(num_key_value_heads=2, sliding_window=None)), seed)


def tiny_qwen2(seed: int = 0, max_window_layers: int = 3):
    # Sliding window on the upper layers, so layer_types and max_window_layers are really per layer.
    config = Qwen2Config(
        **_common(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers
        )
    )
    return _build(config, seed)


def tiny_qwen3(seed: int = 0):
    return _build(Qwen3Config(**_common(num_key_value_heads=2)), seed)


def tiny_gpt2(seed: int = 0, **overrides):
    """GPT-2 (Conv1D storage, fused c_attn, LayerNorm with bias, learned positions, tied embeddings as released).

    `overrides` go to GPT2Config (e.g. ``scale_attn_by_inverse_layer_idx=True``). The larger initializer_range
    makes attention peaked enough that a wrong query scale shows in the logits.
    """
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=overrides.pop("n_positions", 128),
        n_embd=32,
        n_layer=6,
        n_head=4,
        n_inner=48,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.15,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        **overrides,
    )
    model = _build(config, seed)
    # _build randomises norm gains by name ("norm"); GPT-2 names its LayerNorms ln_1, ln_2 and ln_f.
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.split(".")[-2].startswith("ln_") and name.endswith(".weight"):
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def tiny_gpt2_layer_scaled(seed: int = 0):
    """GPT-2 whose attention scores are divided by layer_idx + 1, through the upcast/reordered attention path."""
    return tiny_gpt2(seed, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)


FACTORIES: dict[str, Callable[..., torch.nn.Module]] = {
    "llama_mha": tiny_llama_mha,
    "llama_gqa": tiny_llama_gqa,
    "mistral": tiny_mistral,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
    "baichuan": tiny_baichuan,
    "gpt2": tiny_gpt2,
    "gpt2_layer_scaled": tiny_gpt2_layer_scaled,
}

#: model_type served by each factory, so a registry test can demand a factory for every adapter.
MODEL_TYPES = {
    "llama": "llama_gqa",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "baichuan": "baichuan",
    "gpt2": "gpt2",
}


class CharTokenizer:
    """A tokenizer over bytes folded into the tiny vocabulary: enough for calibration and perplexity tests."""

    eos_token_id = 2
    pad_token_id = 0
    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": [3 + (b % (VOCAB - 3)) for b in text.encode("utf-8")]}

    def save_pretrained(self, path) -> None:  # the tests save models only
        pass


def sample_texts(num: int = 40, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    words = ["state", "union", "the", "of", "people", "nation", "law", "year", "work", "peace", "and", "we"]
    texts = []
    for _ in range(num):
        idx = torch.randint(
            0, len(words), (int(torch.randint(20, 60, (1,), generator=generator)),), generator=generator
        )
        texts.append(" ".join(words[i] for i in idx.tolist()))
    return texts


def tiny_hf_tokenizer():
    """A real (saveable, AutoTokenizer-loadable) character-level tokenizer that fits the tiny vocabulary."""
    from optimum_flatten.utils.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    assert len(tokenizer) <= VOCAB
    return tokenizer


def tiny_marian(seed: int = 0):
    """Marian MT (OPUS-MT layout): post-LN encoder and decoder stacks, sinusoidal positions, tied embeddings.

    The stacks differ in depth (5 / 4), heads (4 / 2) and MLP width (48 / 40), so a key read from the wrong stack
    shows. As in OPUS-MT, the pad token starts decoding and embeddings are scaled; ``final_logits_bias`` is made
    non-zero so that an MT head that forgets it is caught.
    """
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=5,
        decoder_layers=4,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=40,
        max_position_embeddings=128,
        activation_function="swish",
        scale_embedding=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        init_std=0.15,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        forced_eos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
        model.final_logits_bias.copy_(0.5 * torch.randn(model.final_logits_bias.shape, generator=generator))
    model.eval()
    return model


FACTORIES["marian"] = tiny_marian
MODEL_TYPES["marian"] = "marian"


# ------------------------------------------------------------------------------------------ encoders (BERT, ViT)
def _randomise_norms_and_biases(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random LayerNorm gains and biases (matched case-insensitively: BERT says LayerNorm, ViT layernorm_*)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layernorm" in name.lower() and name.endswith(".weight"):
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.eval()
    return model


def tiny_bert(seed: int = 0, **overrides):
    """BertForMaskedLM: post-LN encoder, learned positions, token types, non-gated GELU MLP, tied MLM decoder."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.15,
        pad_token_id=0,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(seed)
    return _randomise_norms_and_biases(BertForMaskedLM(config).to(torch.float32), seed)


VIT_IMAGE_SIZE, VIT_PATCH_SIZE, VIT_CHANNELS = 16, 4, 3


def tiny_vit(seed: int = 0, **overrides):
    """ViTForImageClassification on 16x16 images in 4x4 patches (CLS + 16 positions), pre-LN, GELU MLP."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=VIT_IMAGE_SIZE,
        patch_size=VIT_PATCH_SIZE,
        num_channels=VIT_CHANNELS,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.15,
        num_labels=5,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(seed)
    return _randomise_norms_and_biases(ViTForImageClassification(config).to(torch.float32), seed)


def sample_pixel_values(num: int = 2, seed: int = 0) -> torch.Tensor:
    """(num, 3, 16, 16) random images for the tiny ViT."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num, VIT_CHANNELS, VIT_IMAGE_SIZE, VIT_IMAGE_SIZE, generator=generator)


FACTORIES.update({"bert": tiny_bert, "vit": tiny_vit})
MODEL_TYPES.update({"bert": "bert", "vit": "vit"})


def tiny_starcoder2(seed: int = 0):
    """StarCoder2 (pre-LN with biased LayerNorms, GQA, RoPE, a non-gated c_fc/c_proj MLP): no adapter ships for it;
    tests/adapters/test_layout_example.py declares one from a layout, as docs/contributing shows."""
    from transformers import Starcoder2Config

    config = Starcoder2Config(**_common(num_key_value_heads=2, norm_epsilon=1e-5, use_bias=True, residual_dropout=0.0))
    return _build(config, seed)


FACTORIES["starcoder2"] = tiny_starcoder2


# --------------------------------------------------------------- families of issue 30 (transformers 5.24 configs)
_SW, _FULL = "sliding_attention", "full_attention"


def tiny_gemma2(seed: int = 0):
    """Gemma 2: sliding/full layers alternating (a 4-token window, so the types differ on 12-token inputs)."""
    from transformers import Gemma2Config

    return _build(Gemma2Config(**_common(num_key_value_heads=2, sliding_window=4, query_pre_attn_scalar=8)), seed)


def tiny_gemma3_text(seed: int = 0):
    """Gemma 3 text stack: 2 sliding layers per full one, per-head q/k norms, tied embeddings as released."""
    from transformers import Gemma3TextConfig

    layer_types = [_SW, _SW, _FULL, _SW, _SW, _FULL]
    config = Gemma3TextConfig(
        **_common(num_key_value_heads=2, sliding_window=4, layer_types=layer_types, tie_word_embeddings=True)
    )
    return _build(config, seed)


def tiny_mixtral(seed: int = 0):
    from transformers import MixtralConfig

    return _build(MixtralConfig(**_common(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)), seed)


def tiny_qwen2_moe(seed: int = 0):
    """Qwen2-MoE with sparse layers 1, 3, 5 (decoder_sparse_step=2): dense and sparse layers alternate."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        **_common(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=2,
        )
    )
    return _build(config, seed)


def tiny_qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **_common(
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]
        )
    )
    return _build(config, seed)


def tiny_olmo2(seed: int = 0):
    from transformers import Olmo2Config

    return _build(Olmo2Config(**_common(num_key_value_heads=2)), seed)


def tiny_smollm3(seed: int = 0):
    """SmolLM3 with NoPE on layers 2 and 5."""
    from transformers import SmolLM3Config

    return _build(SmolLM3Config(**_common(num_key_value_heads=2, no_rope_layers=[1, 1, 0, 1, 1, 0])), seed)


def tiny_granite(seed: int = 0):
    """Granite with every multiplier away from 1, so a fold that forgets one shows."""
    from transformers import GraniteConfig

    config = GraniteConfig(
        **_common(
            num_key_value_heads=2,
            residual_multiplier=0.5,
            embedding_multiplier=4.0,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        )
    )
    return _build(config, seed)


def tiny_phi3(seed: int = 0):
    """Phi-3 with GQA (fused qkv_proj of unequal parts [16 | 8 | 8] per head_dim) and partial RoPE."""
    from transformers import Phi3Config

    config = Phi3Config(
        **_common(num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
        partial_rotary_factor=0.5,
    )
    return _build(config, seed)


def tiny_glm4(seed: int = 0):
    """GLM-4: post-sublayer norms, fused gate_up_proj, q/k/v biases, partial RoPE (its default 0.5)."""
    from transformers import Glm4Config

    return _build(Glm4Config(**_common(num_key_value_heads=2, attention_bias=True)), seed)


def tiny_gemma3(seed: int = 0):
    """Gemma3ForConditionalGeneration: the tiny Gemma 3 text stack (as `tiny_gemma3_text`) under a one-layer vision
    tower on 16x16 images; the stack's keys live in the nested text_config."""
    from transformers import Gemma3Config

    text = _common(
        num_key_value_heads=2,
        sliding_window=4,
        layer_types=[_SW, _SW, _FULL, _SW, _SW, _FULL],
        tie_word_embeddings=True,
    )
    text.pop("attn_implementation")
    vision = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    config = Gemma3Config(
        text_config=text,
        vision_config={**vision, "image_size": 16, "patch_size": 4},
        mm_tokens_per_image=4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
        attn_implementation="eager",
    )
    return _build(config, seed)


NEW_FAMILIES = {
    "gemma2": tiny_gemma2,
    "gemma3_text": tiny_gemma3_text,
    "mixtral": tiny_mixtral,
    "qwen2_moe": tiny_qwen2_moe,
    "qwen3_moe": tiny_qwen3_moe,
    "olmo2": tiny_olmo2,
    "smollm3": tiny_smollm3,
    "granite": tiny_granite,
    "phi3": tiny_phi3,
    "glm4": tiny_glm4,
    "gemma3": tiny_gemma3,
}
FACTORIES.update(NEW_FAMILIES)
MODEL_TYPES.update({name: name for name in NEW_FAMILIES})


def remote_code_tokenizer(folder):
    """The tiny tokenizer saved with its class as remote code (as Baichuan-2's ``tokenization_baichuan.py``), the
    class's module importing a second one relatively."""
    import json

    from transformers import AutoTokenizer

    tiny_hf_tokenizer().save_pretrained(folder)
    (folder / "tokenization_tiny_helpers.py").write_text("SUFFIX = 'Tiny'\n")
    (folder / "tokenization_tiny.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\nfrom .tokenization_tiny_helpers import SUFFIX\n\n\n"
        "class TinyRemoteTokenizer(PreTrainedTokenizerFast):\n    suffix = SUFFIX\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyRemoteTokenizer"]}
    config["tokenizer_class"] = "TinyRemoteTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
