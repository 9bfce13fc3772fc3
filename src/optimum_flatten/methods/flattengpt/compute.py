"""FlattenGPT's compute model for `optimum-flatten estimate`: the stack passes of each timed phase and the arithmetic
the ops record in it (`utils.flops`), from the model's shape alone.

Kept apart from the memory model (`workspace.py`): the two answer different questions and change for different
reasons. The stack passes per phase add up to the memory model's total (`flattengpt_workspace`; tested), and the
arithmetic follows the ops' own counts call by call, so an estimate and a compression's report can be read side by
side (tests/test_estimate_compute.py checks them against each other on a tiny model).
"""

from __future__ import annotations

import math
from typing import Any

from ...calibration.precision import SPLIT_GRAM_BAND
from ...compression.compute import Arithmetic, ComputeModel, Tally
from ...compression.workspace import LEVERAGE_PANEL, WorkspaceSizes
from ...ops.block_elimination import DOWNDATE_LAUNCHES, REMOVAL_LAUNCHES, removal_chunks
from ...ops.ridge import max_refined
from ...options.methods.flattengpt import resolve_covariance_dtype
from ...utils import flops
from .choices import (
    MAX_EXHAUSTIVE_SUBSETS,
    cached_member_states,
    cross_path,
    group_size,
    member_runs,
    selection_cache_holds,
)


def flattengpt_phase_passes(z: WorkspaceSizes, n: int, config: Any) -> dict[str, float]:
    """The stack passes of `flattengpt_workspace`, split by the phase whose timer runs them (their sum is its total).

    - selection: the similarity pass (L − 1 layers), or the loss selection's runs;
    - propagate: the original layers run to carry the states past the groups (none with the selection's cache);
    - head_scoring: per group the wide block up to o_proj, and the members' run for the sequential targets;
    - covariance: per group the pruned block up to the down projection, and the members' run for the MLP's
      sequential target when the attention's run did not give it.

    With the selection's cache the sequential targets read the original states it holds (`member_states`): each
    member runs only up to its MLP norm, and the MLP's target runs nothing. A group that ends the stack has no
    cached output and runs its members as without the cache; the plan is not known here, so one group is counted
    that way (`member_runs`: a bound, within one group's members).
    """
    s = z.shape
    L = s.num_layers
    kind = getattr(config, "selection", "similarity")
    by_loss = kind in ("loss", "wide_loss")
    prebuilt = kind == "loss"
    g = group_size(n, L, config)
    cached = selection_cache_holds(z, config)
    p_layer, p_att, p_mlp, p_norm = s.layer_weights, s.attention_weights, s.mlp_weights, s.norm_weights
    groups = n if g == 2 else math.ceil(n / (g - 1))
    sequential = getattr(config, "attention_target", "parallel") == "sequential"
    mlp_target = getattr(config, "mlp_target", "parallel") == "sequential"
    heads = g * (p_att - s.o_weights) + p_norm / 2
    covariance = p_att + p_norm + g * (p_mlp - s.down_weights)
    heads_runs, covariance_runs = member_runs(s, g, sequential, mlp_target, cached)
    heads_runs_end, covariance_runs_end = member_runs(s, g, sequential, mlp_target, False)
    if cached:
        propagation = 0.0
    elif prebuilt:
        propagation = float((L - 2) * p_layer)
    elif config.calibration_mode == "sequential":
        propagation = float(L * p_layer - groups * (g - 1) * p_layer)
    elif mlp_target:
        propagation = float((L - n - groups) * p_layer)
    else:
        propagation = float(L * p_layer)
    if by_loss:
        scored = min(config.scoring_batches or z.cal.batches, z.cal.batches)
        fraction = min(1.0, scored * z.cal.batch_size / z.cal.nsamples)
        block = 1 if prebuilt else g
        merges = [L - k for k in range(n)]
        work = L + sum(G + (G - 1) * (block + G) + (G - 1) * s.head_weights / p_layer for G in merges)
        selection = fraction * work * p_layer
    else:
        selection = float((L - 1) * p_layer)
    if prebuilt:
        groups = sum(L - size + 1 for size in range(2, g + 1))
    unit = L * p_layer
    # One group (the last) ending the stack, if the cache could serve the others (a bound, `member_runs`).
    ends = 1 if groups else 0
    return {
        "selection": selection / unit,
        "propagate": propagation / unit,
        "head_scoring": (groups * heads + (groups - ends) * heads_runs + ends * heads_runs_end) / unit,
        "covariance": (groups * covariance + (groups - ends) * covariance_runs + ends * covariance_runs_end) / unit,
    }


def flattengpt_arithmetic(z: WorkspaceSizes, n: int, config: Any, refined_channels: int | None = None) -> Arithmetic:
    """The arithmetic of each phase, as the ops record it: per merged group (g members, `groups` of them),

    - head_scoring: the o_proj input's second moment, 2·N·(g·H·d_h)² (float32, or TF32 when asked), and with the
      sequential attention target its cross moment with the writes, 2·N·(g·H·d_h)·d (float32 for float32 and tf32
      statistics, float64 for float64 ones; bfloat16 statistics: three times that in bfloat16);
    - attention_solve: the KV groups' search (exhaustive: one refit and error per subset; greedy: per elimination
      step one Cholesky factor and inverse of the kept block, k³/3 + 2k³, two k²·d products, and per remaining KV
      group its small solves and the five scalars it reads), then the kept heads' refit;
    - covariance: the wide MLP's second moment 2·N·(g·i)², and with the sequential MLP target its cross moment with
      the target, 2·N·(g·i)·d (in the precision the head scoring's takes);
    - solve: float32 statistics: the packed Cholesky factor of C + λI and the diagonal of its inverse by panels
      (about w³/3 each, w = g·i), the float64 re-scoring of at most `max_refined(w)` channels near the cut (a
      bound: the number within rounding of the cut is known only at run time), one copy of the scores to the host
      for the ranking, the kept block's factor (i³/3) and its solve (2·i²·d, float64); float64 statistics: the full
      factor and the leverage panels, then the kept block's.

    N = nsamples · seqlen (every calibration position real, as packing gives). The loss selections' candidate
    groups are counted at the largest size (a bound). `refined_channels` sets how many channels the float32 path
    re-scores near the cut (None: the most it may, a bound; a run reports none when no score lies within rounding
    of the cut).
    """
    s, N, d = z.shape, z.N, z.d
    L = s.num_layers
    kind = getattr(config, "selection", "similarity")
    prebuilt = kind == "loss"
    g = group_size(n, L, config)
    groups = n if g == 2 else math.ceil(n / (g - 1))
    if prebuilt:
        groups = sum(L - size + 1 for size in range(2, g + 1))
    float64_model = s.dtype == "float64"
    needs_o = config.attention_correction or config.head_selection == "reconstruction"
    sequential = getattr(config, "attention_target", "parallel") == "sequential"
    mlp_target = getattr(config, "mlp_target", "parallel") == "sequential"
    hw, k_heads = g * s.num_heads * s.head_dim, s.num_heads * s.head_dim
    w, keep = g * s.intermediate_size, s.intermediate_size
    # "auto" as the run on a GPU resolves it (a bfloat16 model is compressed on one; on a CPU it takes float32).
    heads_precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, hw)
    mlp_precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, w)

    head_scoring = Tally()
    if needs_o:
        head_scoring.add(*_moment(N, hw, heads_precision, float64_model))
    if sequential:  # the cross moment with the target: float64, or three split bfloat16 terms in one GEMM
        head_scoring.add(*_cross(N, hw, d, heads_precision, s.dtype))

    attention = Tally()
    if needs_o:
        if config.head_selection == "reconstruction":
            _kv_search(attention, s, g, d, sequential)
        if config.attention_correction:
            _refit(attention, k_heads, hw - k_heads, d, sequential)

    covariance = Tally()
    if mlp_precision == "float64" or float64_model:  # `SecondMoment`: a float32 product of float32 inputs
        covariance.add(flops.gram(N, w), "float64" if float64_model else "float32")
    else:
        covariance.add(*_moment(N, w, mlp_precision, float64_model))
    if mlp_target:
        covariance.add(*_cross(N, w, d, mlp_precision, s.dtype))

    solve = Tally()
    if mlp_precision == "float64":
        solve.cholesky(w)
        solve.add(
            sum(flops.triangular_solve(w - a, min(w, a + LEVERAGE_PANEL) - a) for a in _panels(w)),
            "float64",
            "factorisation",
        )
        solve.reads(1)  # the ranking: one copy of the scores to the host
        if config.mlp_correction:
            _refit(solve, keep, w - keep, d, mlp_target)
    else:
        _packed_leverage(solve, w, keep, refined_channels)
        if config.mlp_correction:
            solve.add(flops.product(keep, keep, d) if mlp_target else flops.product(keep, w - keep, d), "float64")
            solve.cholesky(keep)
            solve.add(flops.cholesky_solve(keep, d), "float64", "factorisation")
    return {
        name: tally.scaled(groups)
        for name, tally in (
            ("head_scoring", head_scoring),
            ("attention_solve", attention),
            ("covariance", covariance),
            ("solve", solve),
        )
        if tally.kinds
    }


def _panels(dim: int) -> range:
    return range(0, dim, LEVERAGE_PANEL)


def _refit(tally: Tally, k: int, r: int, d: int, towards_target: bool) -> None:
    """`ridge_refit_to_target` (C_KK W_K, the factor, the solve) or `nystrom_down_correction` (C_KR W_R instead)."""
    tally.cholesky(k)
    tally.add(flops.product(k, k, d) if towards_target else flops.product(k, r, d), "float64")
    tally.add(flops.cholesky_solve(k, d), "float64", "factorisation")


def _moment(tokens: int, dim: int, precision: str, float64_model: bool) -> tuple[float, str]:
    """(flops, precision) of a second moment's products: float64 for a float64 model; the split bfloat16 products
    (the lower block triangle of one GEMM of three times the tokens, `add_lower_split_gram_`); else float32, on TF32
    tensor cores for ``"tf32"``."""
    if float64_model:
        return flops.gram(tokens, dim), "float64"
    if precision == "bfloat16":
        return flops.lower_gram(3 * tokens, dim, SPLIT_GRAM_BAND), "bfloat16"
    return flops.gram(tokens, dim), flops.precision_of("float32", precision == "tf32")


def _cross(tokens: int, dim: int, out: int, precision: str, dtype: str) -> tuple[float, str]:
    """(flops, precision) of a `CrossMoment` over `tokens` on activations of `dtype` (`cross_path`): on the split
    bfloat16 path `split_cross`'s one bfloat16 GEMM over three times the tokens; float32 products on the centred
    path; else float64 products."""
    path = cross_path(precision, dtype)
    if path == "split":
        return 3 * flops.gram(tokens, dim, out), "bfloat16"
    return flops.gram(tokens, dim, out), "float32" if path == "centred" else "float64"


def _kv_search(tally: Tally, s: Any, g: int, d: int, towards_target: bool) -> None:
    """`select_kv_groups_by_reconstruction` on the wide block's g·KV groups, keeping KV of them."""
    kv, c = s.num_kv_heads, (s.num_heads // s.num_kv_heads) * s.head_dim
    total = g * kv
    hw, k = total * c, kv * c
    subsets = math.comb(total, kv)
    if subsets <= MAX_EXHAUSTIVE_SUBSETS:
        for _ in range(subsets):
            if towards_target:  # `ridge_target_error`: the refit, then C_KK W' and the error read back
                _refit(tally, k, hw - k, d, True)
                tally.add(flops.product(k, k, d), "float64")
                tally.reads(1)
            else:  # `ridge_reconstruction_error`
                r = hw - k
                tally.cholesky(k)
                products = flops.product(k, r, d) + flops.product(d, r, r) + flops.product(d, r, d)
                tally.add(products + flops.product(k, k, d), "float64")
                tally.add(flops.cholesky_solve(k, d), "float64", "factorisation")
                tally.reads(1)
        return
    if not towards_target:  # the wide block's own output as the target: S = C W
        tally.add(flops.product(hw, hw, d), "float64")
    _greedy_elimination(tally, total, kv, c, d)


def _greedy_elimination(tally: Tally, total: int, kv: int, c: int, d: int) -> None:
    """`ops.block_elimination.greedy_block_elimination` of `total` groups of `c` channels down to `kv`, hidden `d`."""
    k = total * c  # one factorisation and inverse of every group's channels
    tally.cholesky(k)
    tally.add(flops.cholesky_inverse(k), "float64", "factorisation")
    tally.add(2 * flops.product(k, k, d), "float64")
    for kept in range(total, kv, -1):  # each step scores every removal, then downdates the refit
        k, r = kept * c, (kept - 1) * c
        per_group = 3 * flops.product(c, c, d) + flops.product(c, k, c) + flops.product(c, c, c)
        tally.add(kept * per_group, "float64")
        tally.add(kept * flops.cholesky_solve(c, d), "float64", "factorisation")
        tally.add(kept * flops.cholesky(c), "float64", "factorisation")  # one batched factorisation a chunk
        chunks = len(removal_chunks([c] * kept, d))
        tally.reads(chunks + 1)  # each chunk's factorisation status, then the errors at once
        tally.launches(REMOVAL_LAUNCHES * chunks)
        # The downdate: the dropped group's factor, two triangular solves, P' = P_K'K' − XᵀX, W', P'D'.
        solves = flops.cholesky(c) + flops.triangular_solve(c, r) + flops.triangular_solve(c, d)
        tally.add(solves, "float64", "factorisation")
        tally.add(flops.product(r, c, r) + flops.product(r, c, d) + flops.product(r, r, d), "float64")
        tally.reads(1)
        tally.launches(DOWNDATE_LAUNCHES)


def _packed_leverage(tally: Tally, w: int, keep: int, refined: int | None = None) -> None:
    """`ridge_leverage_scores_packed` in float32 with `refine_top_k=keep`, and the ranking's scalar reads."""
    B = LEVERAGE_PANEL
    starts = list(_panels(w))
    for index, a in enumerate(starts):  # the left-looking factor
        width = min(w, a + B) - a
        tally.add(sum(flops.product(w - a, min(w, p + B) - p, width) for p in starts[:index]), "float32")
        tally.add(flops.cholesky(width) + flops.triangular_solve(width, w - a - width), "float32", "factorisation")
        tally.reads(1)
    for first, a in enumerate(starts):  # the diagonal of the inverse, by forward substitution
        width = min(w, a + B) - a
        for b in starts[first:]:
            size = min(w, b + B) - b
            tally.add(flops.triangular_solve(size, width), "float32", "factorisation")
            tally.add(flops.product(w - b - size, size, width), "float32")
    m = (max_refined(w) if refined is None else min(refined, max_refined(w))) if 0 < keep < w else 0
    if m:  # at most m channels re-scored: five packed solves, four float64 products with C
        for a in starts:
            width = min(w, a + B) - a
            tally.add(5 * 2 * flops.triangular_solve(width, m), "float32", "factorisation")
            tally.add(5 * 2 * flops.product(w - a - width, width, m), "float32")
        tally.add(4 * flops.product(w, w, m), "float64")
    tally.reads(1)  # the ranking: one copy of the scores to the host


def flattengpt_compute(z: WorkspaceSizes, n: int, config: Any) -> ComputeModel:
    """FlattenGPT's compute model: `flattengpt_phase_passes` and `flattengpt_arithmetic`."""
    notes = ["the solve's float64 re-scoring near the cut is counted at its most channels (a bound)"]
    if cached_member_states(z, config):
        notes.append("one merged group is assumed to end the stack, running its members whole (a bound)")
    if getattr(config, "selection", "similarity") == "loss":
        notes.append("the loss selection's candidate groups are counted at the largest size (a bound)")
    return ComputeModel(flattengpt_phase_passes(z, n, config), flattengpt_arithmetic(z, n, config), notes)
