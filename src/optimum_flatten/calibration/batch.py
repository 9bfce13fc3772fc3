"""One forward's worth of calibration data, text or images: what every method's statistics read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CalibrationBatch:
    """One forward's worth of calibration data; `attention_mask` is 0 on padding, which every statistic skips.

    A text batch holds ``input_ids`` and ``attention_mask`` (batch, seqlen). An image batch holds ``pixel_values``
    (batch, channels, height, width) and no text: its ``input_ids`` / ``attention_mask`` are empty (batch, 0)
    tensors, so code that counts text tokens sees none, and the adapter's ``token_mask`` says which positions of the
    image encoder's states are real (all of them: CLS and patches).

    Text rows are right-padded (`calibration.data` builds them so, whatever the tokenizer's padding side): the
    calibration forwards pass no ``position_ids``, so a left-padded row built by hand would start its tokens at the
    padding's length, which changes the states of a model with absolute positions (GPT-2) though not RoPE's.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor | None = None

    @classmethod
    def from_images(cls, pixel_values: torch.Tensor) -> CalibrationBatch:
        """An image batch (no text) from (batch, channels, height, width) pixel values."""
        empty = torch.zeros(pixel_values.shape[0], 0, dtype=torch.long)
        return cls(input_ids=empty, attention_mask=empty.clone(), pixel_values=pixel_values)

    @property
    def num_tokens(self) -> int:
        """Real text tokens (0 for an image batch)."""
        return int(self.attention_mask.sum())

    @property
    def num_images(self) -> int:
        return 0 if self.pixel_values is None else int(self.pixel_values.shape[0])
