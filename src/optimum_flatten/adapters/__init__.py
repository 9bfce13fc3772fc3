"""Where in a model: one adapter per architecture family. Importing this package registers them all."""

from . import baichuan, bert, gemma, glm4, gpt2, llama, marian, moe, olmo2, phi3, qwen2, smollm3, vit  # noqa: F401  (registration by import)
from .base import ArchitectureAdapter
from .registry import get_adapter, register_adapter, registered_adapters, supported_model_types
from .views import AttentionView, BlockView, HeadGeometry, LinearView, MlpView, NormView

__all__ = [
    "ArchitectureAdapter",
    "AttentionView",
    "BlockView",
    "HeadGeometry",
    "LinearView",
    "MlpView",
    "NormView",
    "get_adapter",
    "register_adapter",
    "registered_adapters",
    "supported_model_types",
]
