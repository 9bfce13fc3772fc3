"""Whether a model is a causal language model, the only kind healing trains, decided before any weight loads.

Healing distils next-token distributions. `AutoModelForCausalLM` accepts more than that: it turns a BERT checkpoint
into a `BertLMHeadModel` (a masked LM trained as if it were causal) and a Marian translation model into a
`MarianForCausalLM` with no encoder. Both load without an error and train on a meaning the model never had, so the
architecture the checkpoint was saved as is checked first and anything else is refused in one line.
"""

from __future__ import annotations

from typing import Any

#: Class-name endings of a causal LM head (``LlamaForCausalLM``, ``GPT2LMHeadModel``), remote code included.
_CAUSAL_ENDINGS = ("ForCausalLM", "LMHeadModel")


def _causal_class_names() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def is_causal_architecture(name: str) -> bool:
    """Whether a class named `name` predicts the next token (a transformers causal-LM class, or named like one)."""
    return name.endswith(_CAUSAL_ENDINGS) or name in _causal_class_names()


def non_causal_description(config: Any, architecture: str | None = None) -> str | None:
    """What a model with `config` (saved as `architecture`, else the config's first ``architectures`` entry) is when it
    is not a causal LM (``"an encoder-decoder model (MarianMTModel)"``); None when it is one or nothing says otherwise.

    A config naming no architecture, or a remote-code one whose ``auto_map`` offers `AutoModelForCausalLM`, passes:
    refusing a model that would have worked is the worse mistake.
    """
    names = [architecture] if architecture else list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder model ({names[0] if names else model_type})"
    if names and not any(is_causal_architecture(name) for name in names):
        if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
            return None
        return f"a {names[0]}, not a causal language model"
    return None


def causal_lm_refusal(config: Any, architecture: str | None = None) -> str | None:
    """Why a model with `config` is not a causal LM that healing can train (`non_causal_description`), as one line;
    None when it is one or when nothing says otherwise."""
    what = non_causal_description(config, architecture)
    if what is None:
        return None
    return (
        f"healing trains causal language models (the next token from those before it), and this checkpoint is {what}; "
        "loading it as a causal LM would train a head it was never trained as. Heal a decoder-only model instead."
    )


def transformers_class_name(model: Any) -> str | None:
    """The model's class name when transformers defines that class (what it was built as, which outranks the
    config's ``architectures``), else None."""
    import transformers

    name = type(model).__name__
    return name if getattr(transformers, name, None) is type(model) else None


def check_causal_lm(model: Any) -> None:
    """Refuses to heal `model` unless it is a causal LM (`causal_lm_refusal`, read from its class when transformers
    defines that class, else from its config), before anything is built or changed.

    Raises:
        ValueError: one line saying what the model is.
    """
    config = getattr(model, "config", None)
    refusal = causal_lm_refusal(config, transformers_class_name(model)) if config is not None else None
    if refusal is not None:
        raise ValueError(refusal)
