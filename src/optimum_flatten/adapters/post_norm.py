"""Families that normalise each sublayer's output before the residual add (Gemma 2/3, GLM-4, OLMo-2), declared as
data: the two post-sublayer norms by name.

What such a norm rules out: the output of two layers' heads concatenated is not the sum of their normalised outputs
(FlattenGPT, CoMe), parameter differences do not add up to the summed updates (LaCo, Sliding-Window Merging), and a
map folded into ``down_proj`` is undone by the norm that follows it (a full ReplaceMe map). What stays exact: the
stream receives each norm's output, so scaling a norm's gain scales what its sublayer writes (compensation, where
every sublayer reads the stream through a scale-invariant norm), and a per-channel map after the MLP is a rescaling of
its output norm's gain (ReplaceMe's ``estimator="diagonal"``, `adapters.mlp_output`).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from .base import ArchitectureAdapter

#: Why families that normalise each sublayer's output before the residual add lack the merges' capabilities.
POST_SUBLAYER_NORM_REASONS: dict[str, str] = {
    "pre_norm": "a norm follows each sublayer's output before the residual add, so norm folding and the sum of "
    "concatenated layers' outputs are not exact",
    "concat_heads": "the post-sublayer norm of a concatenated block would normalise the members' summed outputs, "
    "not each one",
    "parameter_merge": "parameter differences approximate summed residual updates, and a post-sublayer norm "
    "rescales each update to one layer's magnitude",
    "down_fold": "a linear map folded into down_proj is undone by the norm applied after it (estimator 'diagonal' "
    "folds a per-channel map into that norm's gain instead)",
}


class PostSublayerNormAdapter(ArchitectureAdapter):
    """A pre-norm-named stack whose sublayers write through a norm of their own: a family names the two."""

    capabilities = frozenset({"head_geometry", "gated_mlp", "layer_drop", "dense_mlp", "stream_scale"})
    missing_capability_reasons: ClassVar[dict[str, str]] = POST_SUBLAYER_NORM_REASONS
    #: The norms on the attention's and on the MLP's output, relative to the block.
    post_norms: ClassVar[tuple[str, str]]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.mlp_output_norm = cls.post_norms[1]  # a diagonal bridge folds into its gain

    def scale_stream_writes_(self, module: nn.Module, index: int, factor: float) -> None:
        """The sublayers write through their post-norms: scaling those gains scales the writes exactly."""
        for name in self.post_norms:
            self.scale_norm_(module.get_submodule(name), factor)
