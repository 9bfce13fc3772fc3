"""Byte counts of single operations inside FlattenGPT's phases: the float64 temporaries of the attention solve and
of one chunk of a cross moment's update. Apart from the phases (`workspace.py`) because each follows one op's
allocations (`ops.ridge`, `ops.block_elimination`, `calibration.stats.CrossMoment`) and changes with that op."""

from __future__ import annotations

import math
from typing import Any

from ...calibration.cross_moment import CROSS_BLOCK
from ...ops.block_elimination import removal_chunks
from .choices import MAX_EXHAUSTIVE_SUBSETS


def _attention_solve_bytes(
    config: Any, g: int, heads: int, kv_heads: int, head_dim: int, d: int, sequential: bool
) -> int:
    """Float64 temporaries of the attention solve beside the o_proj moment (and the cross moment, counted apart).

    With hw = g·H·d_h o_proj input channels, k = H·d_h kept, r = hw − k dropped and d the hidden size:
    - the refit towards a target (`ridge_refit_to_target`, also each candidate's `ridge_target_error`): first the
      float64 copy of o_proj it takes the kept rows from (8·hw·d + 8·k·d), then the kept block of the moment and
      its factor beside the kept rows, right-hand side, solve and result (16·k² + 4 · 8·k·d), whichever is larger.
    - the Nyström refit (`nystrom_down_correction`, the parallel target) holds the float64 copy of o_proj
      throughout, with the kept block's factor, C[K, R] and its product with the dropped rows (8·hw·d + 16·k² +
      8·k·r + 8·r·d + 16·k·d); each candidate's `ridge_reconstruction_error` also takes C[R, R] (8·r²).
    - the greedy elimination (`ops.block_elimination`), at its first step with k₁ = hw − one group's channels:
      the kept block and its factor, then the factor and the inverse it gives (16·k₁²); after them the inverse, the
      float64 copy of o_proj, and B, W*, W* − W_K, P·(W* − W_K) with the copy B is built from (8·k₁² + 8·hw·d +
      5 · 8·k₁·d), and while one chunk of m channels (`ops.block_elimination.removal_chunks`) is scored its Z and
      two products (3 · 8·m·d); for the parallel target also the cross moment C·W it makes (8·hw·d). Each step's
      downdate holds the old and the new inverse beside those five k₁ × d matrices (16·k₁² + 5 · 8·k₁·d).
    """
    hw, k = g * heads * head_dim, heads * head_dim
    r = hw - k
    reconstruction = config.head_selection == "reconstruction"
    if not (config.attention_correction or reconstruction):
        return 0
    towards_target = max(8 * hw * d + 8 * k * d, 16 * k * k + 4 * 8 * k * d)
    nystrom = 8 * hw * d + 16 * k * k + 8 * k * r + 8 * r * d + 16 * k * d
    refit = (towards_target if sequential else nystrom) if config.attention_correction else 0
    if not reconstruction:
        return refit
    if math.comb(g * kv_heads, kv_heads) <= MAX_EXHAUSTIVE_SUBSETS:
        return max(refit, towards_target if sequential else nystrom + 8 * r * r)
    k1 = hw - (heads // kv_heads) * head_dim
    chunk = removal_chunks([(heads // kv_heads) * head_dim] * (g * kv_heads - 1), d)[0]
    scored = 3 * 8 * chunk[1] * chunk[2] * d  # one chunk's Z and two of its products at a time
    greedy = 5 * 8 * k1 * d + max(16 * k1 * k1, 8 * k1 * k1 + 8 * hw * d + scored) + (0 if sequential else 8 * hw * d)
    return max(refit, greedy)


def _cross_update(chunk: int, dim: int, out: int, path: str, b: int) -> int:
    """One chunk of a `CrossMoment` update (activations of `b` bytes a value, a float32 target): on the float64
    path the float64 copies of both sides; on the centred float32 path (``path="centred"``, float32 and tf32
    statistics) the activations' float32 copy (none when they are float32) and their centred copy, the target's
    centred copy and its float64 copy for the energy, and one block of the product (4·dim·`CROSS_BLOCK`); split
    (``covariance_dtype="bfloat16"``), the centred float32 side, its hi and lo and the stacked three (10 bytes a value
    on the wide side, 14 on the other while the first is still alive), and the float32 product (4·dim·out)."""
    if path == "split":
        return chunk * (10 * dim + 14 * out) + 4 * dim * out
    if path == "centred":  # float32 activations: the centred copy is the chunk's only one
        return 4 * chunk * dim + 12 * chunk * out + 4 * dim * min(out, CROSS_BLOCK)
    return 8 * chunk * (dim + out)
