"""Tiny random models, a character tokenizer and sample text, so every example runs in seconds (`--tiny`).

Nothing here is downloaded: the model is built from a config with random weights and the tokenizer from a
character vocabulary. Results on them mean nothing; they show that a workflow runs end to end.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import torch

_CHARS = string.ascii_lowercase + string.digits + " .,;:!?'-\n" + string.ascii_uppercase
_WORDS = "the people of this nation work for peace and law every year we our state union congress".split()


def tiny_tokenizer() -> Any:
    """A real, saveable character-level tokenizer (PreTrainedTokenizerFast) with about 80 entries."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in _CHARS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_llama(num_layers: int = 6, seed: int = 0) -> Any:
    """A random LLaMA with grouped-query attention (4 heads, 2 KV heads), sized for the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(_CHARS) + 4,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_texts(num: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(30, 90))) + "." for _ in range(num)]


def save_tiny_checkpoint(path: str | Path, num_layers: int = 6) -> Path:
    """Writes a tiny model and its tokenizer as an ordinary checkpoint directory, and returns it."""
    path = Path(path)
    tiny_llama(num_layers).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
