"""ReplaceMe's options: a torch-free declaration, read by `FlattenConfig`, the command line and the method
(methods/replaceme.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..corrections import BridgeOptions
from ..hints import check_scoring_batches
from .uidl import BlockSelectionConfig


@dataclass
class ReplaceMeConfig(BlockSelectionConfig):
    """Options of ReplaceMe (besides the block selection's `tokens` and `num_blocks`).

    Attributes:
        estimator: ``"lstsq"`` (closed form, float64 statistics), ``"lstsq_gain"`` (the same plus one scalar gain
            on the residual stream at the cut, fitted jointly with T and folded into the embeddings and the upstream
            o/down projections as Prune&Comp folds its α; not in either paper, see docs/methods/replaceme.md),
            ``"lstsq_down"`` (the layer's down projection itself refitted on its inputs, shrunk towards T's fold;
            not in the paper, see docs/methods/replaceme.md) or ``"cosine"`` (the paper's cosine objective).
        cosine_epochs, cosine_lr, cosine_minibatch: The cosine fit's bounded Adam run (epochs over all tokens).
        seed: Seeds the cosine fit's token order.
        selection: ``"distance"`` (the paper: smallest angular distance across the block) or ``"loss"`` (every
            start's least-squares replacement scored by next-token NLL; one block, a model with an LM head). The
            final map is fitted with `estimator` either way.
        correct_after: Also refit the down projections of this many kept layers after the block, each towards the
            dense state after it (not in the paper; see docs/methods/replaceme.md). 0: the paper's single map.
        scoring_batches: With ``selection="loss"``, score on the first this-many calibration batches (None: all);
            T is always fitted on every batch. Cost: about (layers - n) suffix runs over the scored batches.
        down_ridge: With ``estimator="lstsq_down"``: the ridge towards T's fold, relative to the mean diagonal of
            AᵀA (0: the plain refit, ``inf``: the paper's map); None chooses it on the last calibration batch.
        held_states_gb: The selection walk keeps the calibration states around the best block whole (a window of
            size + 2 boundaries and the best pair: size + 4 copies of the states at most) when they take at most this
            many GB, and the least-squares fit reads them: one layer's run instead of a second walk of the dense
            stack up to the block's end. Above it the selection walks the stack once batch by batch instead and
            accumulates the fit's statistics for the `fit_shortlist` starts nearest on the first batch, as many as this
            budget holds (`methods/replaceme_one_pass.py`); 0: the fit streams its own walk, holding nothing. The same
            map every way (the same runs, in the same order).
        fit_shortlist: How many starts the one-pass walk accumulates statistics for (float64, 2·8·d² bytes each with
            ``"lstsq"``). When the block the distances choose over all batches is among them, the fit needs no second
            walk; otherwise it streams one. 0: never walk once.
    """

    estimator: str = "lstsq"
    cosine_epochs: int = 10
    cosine_lr: float = 1e-4
    cosine_minibatch: int = 1024
    seed: int = 0
    selection: Literal["distance", "loss"] = "distance"
    scoring_batches: int | None = 1
    correct_after: int = 0
    down_ridge: float | None = None
    held_states_gb: float = 4.0
    fit_shortlist: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        self.bridge_options()  # BridgeOptions checks the estimator and the cosine fit's bounds
        if self.selection not in ("distance", "loss"):
            raise ValueError(f"selection must be 'distance' or 'loss', got {self.selection!r}.")
        if self.selection == "loss" and self.num_blocks != 1:
            raise ValueError("selection='loss' chooses one block; use num_blocks=1 or selection='distance'.")
        check_scoring_batches(self.scoring_batches)
        gb = self.held_states_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb >= 0:
            raise ValueError(f"held_states_gb must be a number of GB, 0 or more, got {gb!r}.")
        if isinstance(self.fit_shortlist, bool) or not isinstance(self.fit_shortlist, int) or self.fit_shortlist < 0:
            raise ValueError(f"fit_shortlist must be a whole number of starts, 0 or more, got {self.fit_shortlist!r}.")

    def bridge_options(self) -> BridgeOptions:
        return BridgeOptions(
            self.estimator,
            self.cosine_epochs,
            self.cosine_lr,
            self.cosine_minibatch,
            self.correct_after,
            self.down_ridge,
        )
