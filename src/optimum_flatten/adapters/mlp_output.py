"""What a block's MLP adds to the residual stream, for the bridges that fit a map after it and fold it in.

ReplaceMe's map T (and every `linear_replacement`) is fitted on the MLP's output as the stream receives it and
folded into whatever writes that output. In a plain pre-norm block that is one down projection; a mixture of experts
writes it through every expert's and the shared expert's (`adapters.moe`); Granite multiplies it by
``residual_multiplier`` before the add (`adapters.smollm3`); Gemma, OLMo-2 and GLM-4 normalise it before the add
(`mlp_output_norm`), so only a diagonal map folds, into that norm's gain. `ArchitectureAdapter` takes these from
`MlpOutput`, and a family overrides only what differs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..ops.linear_map import fold_map_into_linear


class MlpOutput:
    """The MLP's write to the stream: its width, its multiplier, its writers and the fold (mixed into the adapter)."""

    #: The norm applied to the MLP's output before the residual add, relative to the block (Gemma's
    #: ``post_feedforward_layernorm``), or None. Where there is one, the stream receives the norm's output, and the
    #: one exact fold of a map after it is a diagonal one, into its gain.
    mlp_output_norm: ClassVar[str | None] = None

    def mlp_write_points(self, module: nn.Module, index: int) -> tuple[nn.Module, nn.Module]:
        """(the module whose output is what the MLP sublayer adds to the stream, the module whose input is the stream
        it is added to): the MLP or its output norm; the MLP's pre-norm, or the MLP itself where no norm precedes it
        (OLMo-2)."""
        block = self.block_view(module, index)
        written = module.get_submodule(self.mlp_output_norm) if self.mlp_output_norm else block.mlp.module
        stream = block.mlp.module if block.norm_position == "post" else block.mlp_norm.module
        return written, stream

    def mlp_output_width(self, module: nn.Module, index: int) -> int:
        """The width of what the MLP adds to the stream (the stream's, as o's output): what a bridge maps."""
        return self.block_view(module, index).attention.o.out_features

    def mlp_output_multiplier(self, module: nn.Module, index: int) -> float:
        """The factor the block applies to the MLP module's output before the add (1; Granite's multiplier): a
        bridge scales what it captures by it, so its statistics see what the stream receives."""
        return 1.0

    def mlp_active_width(self, module: nn.Module, index: int) -> int:
        """The intermediate width one token activates: the MLP's (a mixture: its routed experts' and shared one's)."""
        return self.block_view(module, index).mlp.intermediate_size

    def mlp_writers(self, module: nn.Module, index: int) -> list[nn.Parameter]:
        """The parameters that write the MLP output (what a bridge folded after the MLP changed)."""
        if self.mlp_output_norm:
            return list(module.get_submodule(self.mlp_output_norm).parameters())
        return list(self.block_view(module, index).mlp.down.module.parameters())

    def fold_after_mlp_(self, module: nn.Module, index: int, transform: torch.Tensor) -> None:
        """Folds the row-vector map `transform` after the MLP output into what writes it: by default the down
        projection (``W' = Tᵀ W``, ``b' = b T``, float64); a mixture every expert's (the MoE adapter).

        A multiplier applied after the MLP commutes with the map (both are linear), so the fold is the same. Where a
        norm follows the MLP (`mlp_output_norm`) the map must be diagonal and scales that norm's gain per channel.

        Raises:
            ValueError: a map with off-diagonal entries where only a diagonal one folds exactly.
        """
        if self.mlp_output_norm:
            diagonal = transform.diagonal()
            if not torch.equal(transform, torch.diag(diagonal)):
                raise ValueError(
                    f"{type(self).__name__} normalises the MLP output before the residual add; only a diagonal map "
                    "folds into that norm's gain (estimator 'diagonal')."
                )
            norm = module.get_submodule(self.mlp_output_norm)
            self.scale_norm_(norm, diagonal.to(norm.weight.device, torch.float64))
            return
        down = self.block_view(module, index).mlp.down
        down.set_(*fold_map_into_linear(down.weight, down.bias, transform.to(down.weight.device)))
