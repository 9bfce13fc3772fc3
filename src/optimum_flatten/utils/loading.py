"""Loading a checkpoint as the class it was saved from, whatever the family (causal LM, encoder, seq2seq, vision).

`AutoModelForCausalLM` would turn a Marian checkpoint into a decoder without its encoder and refuses BERT or ViT;
the class named in `config.architectures` is what the user saved, so the compressed model keeps its head.
"""

from __future__ import annotations

from typing import Any


def model_class_for(config: Any) -> type:
    """The transformers class named first in `config.architectures`; AutoModelForCausalLM when there is none.

    Raises:
        ValueError: when the named class does not exist in the installed transformers (remote code: pass
            trust_remote_code=True, which the Auto class handles).
    """
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        return transformers.AutoModelForCausalLM
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise ValueError(
            f"the checkpoint names architecture {names[0]!r}, which transformers {transformers.__version__} does not "
            "define; for remote code pass trust_remote_code=True (loaded through the Auto class its auto_map names)."
        )
    return cls


def load_pretrained(path: str, **kwargs: Any) -> Any:
    """The model at `path` as the class it was saved from (`config.architectures`), in eval mode.

    Remote-code checkpoints (`trust_remote_code=True`: Baichuan, a partly collapsed LayerCollapse model) go through
    the first Auto model class their `auto_map` lists (AutoModelForCausalLM when it lists none), which resolves it.
    """
    import transformers

    remote = kwargs.get("trust_remote_code", False)
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=remote)
    auto_map = getattr(config, "auto_map", None) or {}
    if remote and auto_map:
        autos = [name for name in auto_map if name.startswith("AutoModel") and hasattr(transformers, name)]
        cls = getattr(transformers, autos[0]) if autos else transformers.AutoModelForCausalLM
    else:
        cls = model_class_for(config)
    return cls.from_pretrained(path, **kwargs).eval()


def load_processor(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved with the checkpoint, or its image processor for a vision model (None if neither)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        try:
            return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError):
            return None
