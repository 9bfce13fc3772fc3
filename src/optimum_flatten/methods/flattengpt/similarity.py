"""FlattenGPT's selection pass: the mean cosine similarity of every pair of layer inputs within a band, in one
layer-by-layer walk of the original model, and what it leaves for the merge (`SelectionCache`)."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ...adapters.base import ArchitectureAdapter
from ...calibration.capture import LayerwiseRunner
from ...calibration.distributed import all_reduce_, all_reduce_sums
from ...compression.method import MethodContext
from ...options.methods.flattengpt import FlattenGPTConfig
from .choices import band_size

logger = logging.getLogger(__name__)


def similarity_matrix(
    adapter: ArchitectureAdapter, context: MethodContext, config: FlattenGPTConfig
) -> tuple[torch.Tensor, SelectionCache]:
    """S[i, j] (i < j, within the band) = mean cosine similarity of the inputs of layers i and j.

    One layer-by-layer pass of the original model; only the inputs of the last `band` layers are held. When the
    band is the whole stack, every layer's unit-normalised input is held anyway: with the per-token norms kept
    beside them (N floats a layer) they are the layer inputs themselves, which `apply_` then takes instead of
    running the original model a second time (the returned `SelectionCache`).
    """
    runner = context.new_runner(adapter)
    num_layers = adapter.num_layers(context.stack)
    band = config.similarity_band or similarity_band(runner, num_layers, config)
    context.report["similarity_band"] = band
    similarity = torch.full((num_layers, num_layers), float("nan"), dtype=torch.float64)
    # Unit-normalised copies of the inputs of the last `band` layers: a cosine is then a row-wise dot product.
    window: deque[tuple[int, list[torch.Tensor]]] = deque(maxlen=band)
    norms: dict[int, list[torch.Tensor]] = {}
    keep_norms = band >= num_layers
    masks = [m.to(torch.float64) for m in runner.masks]
    (num_tokens,) = all_reduce_sums(float(sum(m.sum() for m in masks)))  # all ranks' tokens when sharded
    current = runner.inputs
    dtype = current[0].dtype
    layers = adapter.layers(context.stack)
    with context.timer("selection"), context.progress_bar(num_layers, "similarity") as bar:
        for i in range(num_layers):
            similarity[i, i] = 1.0
            pairs = [unit_rows_and_norms(h) for h in current]
            normalised = [unit for unit, _ in pairs]
            if keep_norms:
                norms[i] = [norm for _, norm in pairs]
            del pairs
            for j, states in window:
                # `vecdot` is the row-wise (a * b).sum(-1) without its product temporary: on the CPU the same float32
                # sums bit for bit at SmolLM2's batches (8 x 512 x 576), in three quarters of the time.
                total = sum(
                    float((torch.linalg.vecdot(a, b).double() * m.to(a.device)).sum())
                    for a, b, m in zip(states, normalised, masks, strict=True)
                )
                # The sum of this rank's share: divided once the ranks' sums are added (after the walk).
                similarity[j, i] = similarity[i, j] = total
            # The loop variable would keep the oldest copy alive past the append that drops it (one more
            # float32 copy of every state during the layer run below: 4 GiB at LLaMA-2-7B, measured on an H100).
            states = None
            window.append((i, normalised))
            if i < num_layers - 1:
                current = runner.run(layers[i], i, current)
            bar.set_description(f"block {i + 1}/{num_layers}: similarity")
            bar.update()
    # One collective for the whole matrix under a sharded calibration (the NaN outside the band is every rank's).
    similarity = all_reduce_(similarity) / num_tokens
    similarity.fill_diagonal_(1.0)
    units = dict(window) if keep_norms else None
    return similarity, SelectionCache(context, runner, units, norms if keep_norms else None, dtype)


def similarity_band(runner: LayerwiseRunner, num_layers: int, config: FlattenGPTConfig) -> int:
    """`choices.band_size` at this calibration's states (every rank's share under a sharded calibration: the ranks
    must choose one band, the one of one process)."""
    (copy_bytes,) = all_reduce_sums(sum(h.numel() * 4 for h in runner.inputs))
    band = band_size(int(copy_bytes), num_layers, config)
    if band < num_layers:
        logger.info(
            "similarity: %d copies of the calibration states exceed %.1f GB; comparing each layer with its %d "
            "predecessor(s) only",
            num_layers,
            config.similarity_memory_gb,
            band,
        )
    return band


def unit_rows(hidden: torch.Tensor) -> torch.Tensor:
    """Token vectors scaled to unit length in float32 (normalised in float64 first, so no overflow or bias)."""
    return unit_rows_and_norms(hidden)[0]


def unit_rows_and_norms(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`unit_rows` and the float64 token norms it divided by (unit × norm gives the token back)."""
    h = hidden.double()
    norms = h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (h / norms).float(), norms


def as_cached(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` as `SelectionCache.inputs` would give it back: unit × norm of its unit-normalised float32 copy.

    A resumed run skips the selection, so it has no cache; it propagates the exact states and rounds each group's
    input through this to measure the group on what the uninterrupted run measured it on, bit for bit.
    """
    unit, norm = unit_rows_and_norms(hidden)
    return (unit.double() * norm).to(hidden.dtype)


@dataclass
class SelectionCache:
    """What the similarity pass leaves for `apply_` on the same context: its runner (so the layer-0 states and the
    call arguments are not recorded a second time) and, when the band held every layer, the unit-normalised inputs
    and token norms of the layers that start a merged group (and of those its sequential targets read). In the
    one-pass mode those are the states the application measures each group on, so it needs no second pass through
    the original model: the inputs come back as unit × norm, computed in float64 and rounded to the model dtype
    (equal to the original states but for one rounding of the float32 unit copies: at most about 1e-7 relative in
    float32; 16-bit states come back exactly).
    """

    context: MethodContext
    runner: LayerwiseRunner
    units: dict[int, list[torch.Tensor]] | None
    norms: dict[int, list[torch.Tensor]] | None
    dtype: torch.dtype
    #: How many more times each kept layer's inputs will be asked for (`keep_only`).
    uses: Counter[int] = field(default_factory=Counter)

    def keep_only(self, uses: Iterable[int]) -> None:
        """Drops every layer's copy but those in `uses`, each kept until it has been asked for as many times as it
        occurs there (a group's output is the next group's input when they touch)."""
        self.uses = Counter(uses)
        if self.units is not None and self.norms is not None:
            self.units = {i: self.units[i] for i in self.uses}
            self.norms = {i: self.norms[i] for i in self.uses}

    def inputs(self, index: int) -> list[torch.Tensor]:
        """The states entering layer `index`; the copy is dropped once handed out for the last time."""
        if self.units is None or self.norms is None or index not in self.units:
            raise KeyError(index)
        self.uses[index] -= 1
        last = self.uses[index] <= 0
        units = self.units.pop(index) if last else self.units[index]
        norms = self.norms.pop(index) if last else self.norms[index]
        return [(u.double() * n).to(self.dtype) for u, n in zip(units, norms, strict=True)]
