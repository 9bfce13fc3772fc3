"""Export: plain checkpoints that load with transformers alone, with report, model card and plots."""

from .checkpoint import save_compressed
from .model_card import render_model_card

__all__ = ["render_model_card", "save_compressed"]
