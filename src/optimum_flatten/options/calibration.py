"""Calibration options: how much text, cut how (torch-free, read by the config, the command line and the methods)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CalibrationConfig:
    """How much calibration text to use and how to cut it.

    Attributes:
        dataset: A list of strings, a path to a .txt/.jsonl/.json/.csv/.parquet file or a folder of .txt files, a
            `datasets.Dataset`, or a dataset name loaded through `datasets` (``"wikitext2"`` is WikiText-2 raw train,
            the paper's default; needs the network).
        nsamples: Number of calibration sequences (paper: 128).
        seqlen: Tokens per sequence (paper: 2048). The calibration size is ``nsamples * seqlen`` tokens.
        seed: Seed for choosing which windows of the text are used.
        batch_size: Sequences per forward call while calibrating; bounds activation memory, not the result.
        packing: True concatenates the texts and cuts non-overlapping ``seqlen`` windows (no padding, the
            paper's protocol). False keeps one text per row, truncated to ``seqlen`` and right-padded; padding
            is masked out of every statistic.
        text_column: Column holding the text in tabular inputs (jsonl, csv, parquet, `datasets`).
        own_text: Share of the ``nsamples`` sequences the model writes itself before it is compressed (sampled from
            its start token at temperature 1, `recovery.own_calibration`); the rest are drawn from `dataset`. 0 (the
            default) calibrates on the dataset alone. Below 1: the model's text alone was a poor calibration text
            (benchmarks/NOTEBOOK.md, "Half the calibration text written by the dense model").
    """

    dataset: Any = None
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    batch_size: int = 8
    packing: bool = True
    text_column: str = "text"
    own_text: float = 0.0

    def __post_init__(self) -> None:
        from ..utils.loading import check_not_a_description
        from .hints import check_option_types

        check_not_a_description(self.dataset, "dataset", "FlattenConfig.from_dict(saved, dataset=texts)")
        # By the hints (dataset is any source): a string "false" for packing would pack, a string seed another draw.
        check_option_types(CalibrationConfig, {k: v for k, v in vars(self).items() if k != "dataset"})
        for name in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=8.")
        if not 0.0 <= self.own_text < 1.0:
            raise ValueError(
                f"own_text is the share of calibration sequences the model writes itself, in [0, 1); got "
                f"{self.own_text!r} (the model's text alone is a poor calibration text: mix it with a dataset)."
            )
        if self.own_text and self.nsamples < 2:
            raise ValueError(
                f"own_text={self.own_text} needs nsamples >= 2 (its rows and the dataset's); got {self.nsamples}."
            )


def own_row_count(config: CalibrationConfig) -> int:
    """How many of the ``nsamples`` rows the model writes (``own_text``): that share of them, at least one, and one
    fewer than all (the option promises the dataset a share)."""
    return min(max(1, round(config.own_text * config.nsamples)), config.nsamples - 1)
