"""FlattenGPT's memory model for `optimum-flatten estimate`: what its selection, flatten, head scoring, covariance
and solves hold at their peaks (`FlattenGPTMethod.workspace`). Kept beside the method in a module of its own: it is
as long as the method's phases are many, and it changes when they do."""

from __future__ import annotations

import math
from typing import Any

from ...calibration.stats import CROSS_BLOCK, SPLIT_GRAM_BAND
from ...compression.workspace import LEVERAGE_PANEL, Phase, Term, WorkspaceModel, WorkspaceSizes
from ...ops.block_elimination import removal_chunks
from ...ops.ridge import max_refined
from ...options.methods.flattengpt import resolve_covariance_dtype

#: The reconstruction search tries every subset of KV groups up to this many subsets, else eliminates greedily.
MAX_EXHAUSTIVE_SUBSETS = 4096
#: Tokens per float64 chunk of the MLP's cross moment with its target (`mlp_target="sequential"`).
MLP_CROSS_CHUNK = 1024


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


def cross_path(precision: str, dtype: str) -> str:
    """The path a `CrossMoment` of statistics taken in `precision` runs on activations of `dtype` (FlattenGPT builds
    it by this rule, and the memory and compute models read it): "split"; "centred" for float32 or tf32 statistics
    of float32 activations; else "float64" (float64 statistics or activations, and bfloat16 activations under float32
    statistics, LLaMA-2-70B's MLP on a GPU, whose float64 products its GPU rows measured)."""
    if precision == "bfloat16":
        return "split"
    return "centred" if precision in ("float32", "tf32") and dtype.removeprefix("torch.") == "float32" else "float64"


def flattengpt_workspace(z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
    """FlattenGPT: a similarity pass, then per merged group a wide block, two statistics and their solves.

    The application reuses the selection's runner (one S), and each compressed block takes its first member's place
    as soon as it is built (and, without the cache below, propagated): no block is held beside the one it replaces.

    - selection: the runner (S) and the states entering and leaving the layer being run (S + run outputs), plus
      `band` float32 unit-normalised copies of the states (the similarity window; the automatic band is the whole
      stack when L copies fit `similarity_memory_gb`, else max_group_size − 1), and, when the last layer is
      normalised, the copies of its earlier batches and one batch's float64 temporaries (20·T_b·d). With the whole
      stack in the band, the float64 token norms of every layer (8·N each) are kept too.
    - the **cache**: with the whole stack in the band and `calibration_mode="one_pass"`, the unit copies and norms of
      the layers that start a merged group stay after the plan (n of them, fewer as groups are done), and each
      group's input is rebuilt from them (S): the application runs no layer of the original model again. With a
      sequential target the copies of the layers it reads stay too (the later members' inputs and the group's
      output: g more per group), and the head scoring holds the later members' inputs ((g − 1)·S) while each
      member's attention runs for its write.
      Otherwise the states entering the group (S) come from propagating the original layers.
    - flatten: the states entering the group, the group's member copies (g layers) and the wide block (g layers),
      which starts as a copy of the first member whose weights are replaced one by one (its down projection, d·i,
      is the last to go).
    - head_scoring: the wide block (g layers); the o_proj input second moment (float64, (g·H·d_h)²); the wide block
      runs each batch only up to its o_proj input, where it holds q, k, v and the attention output while the head
      scores take two float64 copies of that input (16·T_b·g·H·d_h) and the moment its own update. With
      `attention_target="sequential"` also the members' attention writes (float32, S32), built by running the
      members in turn (a member's outputs, S, held meanwhile), and their float64 cross moment with the o_proj
      input ((g·H·d_h)·d). With `mlp_target="sequential"` as well (the defaults) that run goes on through the last
      member, and the group's output it leaves (S) is held from then on for the MLP's target: the members run once
      per group, not twice.
    - with `mlp_target="sequential"` the covariance also holds the original group's output (S, built by running the
      members whole) and the float64 cross moment of the down input with the target ((g·i)·d), each batch adding
      its float32 target and float64 chunk copies; the solve keeps that moment (S_K − C_KK W_K, built beside
      C[K, K] and W_K, stays under the kept solve's two factors).
    - without the cache, in the one-pass mode, those outputs are the group's propagation: they stay through the solve
      and the members do not run again (only the kept layers propagate).
    - attention_solve (the writes are freed; the moments stay, and with both sequential targets the group's output):
      the kept heads' refit, or the search for the KV groups and then the refit, in float64 (`_attention_solve_bytes`).
    - covariance (the o_proj moment is freed before it; the wide block has its pruned attention): the MLP statistic
      C — `covariance_dtype="float32"`: a float32 scatter 4·(g·i)², each batch adding, in chunks of 4096 tokens, a
      centred float32 copy straight into it; "float64": 8·(g·i)² and one float32 (g·i)² product per batch — and the
      block's MLP activations up to the down projection (which does not run): act(gate), up and their product
      while it is computed, then the product with the update's masked token copy and centred chunk.
    - solve, float32 (w = g·i channels, k = i kept, r = w − k dropped, B = 1024-channel panels), the largest of:
      (a) the leverage scores: the scatter, the factor's lower-triangular panels in float32 (4·(w² + w·B)/2), one
      panel read from C in float64 and cast (12·w·B; one panel of L⁻¹ and its square are less), or the float64
      re-scoring of the m channels nearest the cut (4 float64 w × m blocks and a float64 panel of C, m =
      `max_refined(w)` at most: a bound); (b) reading the kept blocks: the scatter, C[K, K] and C[K, R] W_D[R]
      in float64 (8·k² + 8·k·d) and one chunk's copies ((4·w + 12·k)·B + 8·B·d); (c) after the scatter is dropped:
      the float64 Cholesky factor of C[K, K] + λI (C[K, K] itself is dropped once factorised) and the column-major
      copy of it that the solve makes (8·k² each), C[K, R] W_D[R], the float64 kept rows, the solve and their sum
      (4 · 8·k·d). float64: C, its full factor and three (w × B) float64 panels, or the Nyström correction
      (the k × k factor and the k × r block of C, float64 copies of W_down), whichever is larger.
    - propagate (without the cache): the states entering and leaving the layer, and the group's compressed block
      until it replaces its first member (none when the group's outputs are reused: only kept layers run).

    g is max_group_size (with None, the worst case n + 1); n groups at most (exactly n with pairs).
    Cost: the selection runs L − 1 layers; without the cache the application runs every layer once more (the
    members of a group too, on the original model's states); per group the wide block runs twice, each time only up
    to the statistic: all heads up to o_proj, then the pruned attention and the MLP up to the down projection.
    """
    s, b, d, i = z.shape, z.b, z.d, z.i
    L = s.num_layers
    kind = getattr(config, "selection", "similarity")
    by_loss = kind in ("loss", "wide_loss")
    # selection="loss" compresses every run of 2..max_group_size layers before choosing: each size occurs.
    prebuilt = kind == "loss"
    g = min(config.max_group_size, L) if prebuilt else min(config.max_group_size or n + 1, n + 1, L)
    candidates = sum(L - size + 1 for size in range(2, g + 1)) if prebuilt else 0
    band = config.similarity_band or _auto_band(z, config, L)
    cached = selection_cache_holds(z, config)
    scored = min(config.scoring_batches or z.cal.batches, z.cal.batches) if by_loss else 0
    fraction = min(1.0, scored * z.cal.batch_size / z.cal.nsamples)
    scored_states = int(z.S * fraction)
    width = g * i  # the wide MLP: the statistic C is width x width
    heads_width = g * s.num_heads * s.head_dim
    keep, rest = i, width - i
    # "auto" as the run on a GPU resolves it (a bfloat16 model is compressed on one; on a CPU it takes float32).
    precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, width)
    heads_precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, heads_width)
    heads_split = heads_precision == "bfloat16"
    float64 = precision == "float64"
    # covariance_dtype="bfloat16": the float32 path's solve on a float64 scatter of split bfloat16 products.
    split = precision == "bfloat16"
    needs_o = config.attention_correction or config.head_selection == "reconstruction"
    norm_bytes = s.norm_weights * b
    wide = Term(
        "wide block", g * (s.attention_weights + s.mlp_weights) * b + norm_bytes, f"the {g} members side by side"
    )
    pruned = Term(
        "wide block with its pruned attention",
        (s.attention_weights + g * s.mlp_weights) * b + norm_bytes,
        "the kept heads and the g members' MLP channels",
    )
    o_moment = Term(
        "o_proj input second moment (float64)",
        8 * heads_width * heads_width if needs_o else 0,
        "(g·H·d_h)², for the attention refit; freed before the MLP statistics",
    )
    c_bytes = (8 if float64 or split else 4) * width * width
    c_moment = Term(
        f"MLP second moment C ({precision})",
        c_bytes,
        "(g·i)², the ridge statistics" + ("" if float64 else ": a centred scatter, the mean part kept in float64"),
    )
    sequential = getattr(config, "attention_target", "parallel") == "sequential"
    mlp_target = getattr(config, "mlp_target", "parallel") == "sequential"  # refused without mlp_correction
    reads_cache = cached and (sequential or mlp_target)  # `cached_member_states`
    # Per group its first layer's input, and reading the cache, its later members' and the layer's after it.
    per_group_units = 1 + ((g - 1 if sequential else 0) + (1 if mlp_target else 0) if reads_cache else 0)
    cache = Term(
        "cached inputs of the merged groups' first layers"
        + (" and of the layers their sequential targets read" if reads_cache else ""),
        min((n - 1) * per_group_units, L) * (z.S32 + 8 * z.N) if cached else 0,
        "unit copies and float64 norms from the selection, fewer per group done",
    )
    apply_base = [
        z.tokens(),
        *z.runners(1),
        Term(
            "the loss selection's runner: layer-0 states on the scored batches",
            0 if prebuilt else scored_states,
            "the context keeps each runner it opened",
        ),
        Term(
            "compressed candidate groups built so far",
            max(candidates - 1, 0) * s.layer_bytes,
            "selection='loss': every candidate group compressed before choosing, one layer each",
        ),
        cache,
        Term("states entering the group", z.S, "rebuilt from the cache" if cached else "the propagated stream"),
    ]
    copies = min(band, L - 1)
    normalise = z.S32 * (z.cal.batches - 1) // z.cal.batches + 20 * z.Tb * d
    selection = Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("states entering the layer", z.S, "one boundary of the stack"),
            Term(f"float32 unit copies in the similarity band ({copies})", copies * z.S32, f"band = {band}"),
            Term("float64 token norms of every layer", L * 8 * z.N if band >= L else 0, "the cache's norms"),
            Term(
                "largest per-batch work: a layer run, or normalising the last layer",
                max(z.run_outputs() + z.block_forward(), normalise),
                "run outputs + block temporaries, or one more float32 copy + float64 temporaries",
            ),
        ),
    )
    if by_loss:
        selection = _loss_selection_phase(z, n, g, scored_states, fraction, candidates)
    flatten = Phase(
        "flatten",
        (
            *apply_base,
            Term(
                "member copies and the wide block, with the last weight of the copy it starts from",
                2 * g * s.layer_bytes + d * i * b,
                "the wide block starts as a copy of the first member whose weights are replaced one by one",
            ),
        ),
    )
    if by_loss and not prebuilt and selection.bytes > flatten.bytes:
        # The selection builds every candidate's wide block under the same phase name, beside its own states.
        flatten = Phase("flatten", selection.terms)
    at_o_hook = (d + 2 * heads_width + 2 * g * s.num_kv_heads * s.head_dim) * z.Tb * b
    head_hook = max(16 * z.Tb * heads_width, z.moment_update(heads_width, heads_split) if needs_o else 0)
    # attention_target="sequential": the members' attention writes (float32, one states copy) are built by running
    # the members one after another (the first's outputs held while the next runs), then read batch by batch
    # beside the wide block's o_proj input into a float64 cross moment (heads × hidden), a chunk at a time.
    # The moment's update and the cross moment's run one after the other: the centred path takes the larger, the
    # others keep the sum their GPU rows measured (as the MLP's statistics below).
    heads_cross = cross_path(heads_precision, s.dtype)
    cross_update = _cross_update(min(4096, z.Tb), heads_width, d, heads_cross, b) if sequential else 0
    # Both sequential targets: the members' run for the writes goes on to the group's output, which then waits for
    # the MLP's target through the head scoring and the attention solve (one run of the members instead of two).
    traced = Term(
        "the original group's output, traced with the writes",
        z.S if mlp_target and (sequential or reads_cache) else 0,
        "both sequential targets, or the MLP's read from the cache: one states copy, kept for the MLP's target",
    )
    head_scoring = Phase(
        "head_scoring",
        (
            *apply_base,
            wide,
            o_moment,
            Term(
                "the members' sequential attention writes (float32)",
                z.S32 if sequential else 0,
                "attention_target='sequential': one states copy, freed batch by batch",
            ),
            Term(
                "o_proj input-target cross moment (float64)", 8 * heads_width * d if sequential else 0, "(g·H·d_h) × d"
            ),
            traced,
            Term(
                "the later members' inputs, rebuilt from the cache",
                (g - 1) * z.S if reads_cache and sequential else 0,
                "each member's attention runs on its own input: freed once the writes are in",
            ),
            Term(
                "one batch of the wide block, stopped at the o_proj input",
                max(
                    at_o_hook
                    + (head_hook + cross_update if heads_cross != "centred" else max(head_hook, cross_update)),
                    z.S + z.block_forward() if sequential else 0,
                ),
                "q, k, v, attention output; float64 head scores; the moment's token copies and product"
                + (
                    "; or the members' run for the writes: a member's outputs and one batch's temporaries"
                    if sequential
                    else ""
                ),
            ),
        ),
    )
    chunk = min(4096, z.Tb)
    upcast = 4 if b != 4 else 0
    # The masked token copy, then per chunk its float64 column sum or its float32 centred copy (and the cast to it).
    update = z.moment_update(width) if float64 else z.Tb * width * b + chunk * width * max(8, 4 + upcast)
    if split:  # the masked copy; per chunk its centred float32 copy, [hi; hi; lo; hi] and y − hi, a band's product
        update = z.Tb * width * b + chunk * width * (4 + 4 * 2 + 4) + 4 * width * min(SPLIT_GRAM_BAND, width)
    # The MLP peaks at act(gate), up and their product; at the hook only the product (the down input) is left.
    mlp_forward = ((3 if s.gated_mlp else 2) * width + 2 * d) * z.Tb * b
    at_down_hook = max(mlp_forward, (width + 2 * d) * z.Tb * b + update)
    attention_temporaries = z.block_forward(1, s.num_heads, s.num_kv_heads)
    # mlp_target="sequential": the float64 cross moment of the down input with the target, and per batch the float32
    # target (the group's output less the MLP input residual) with one chunk's copies (`_cross_update`).
    mlp_cross = Term("down input-target cross moment (float64)", 8 * width * d if mlp_target else 0, "(g·i) × d")
    mlp_cross_path = cross_path(precision, s.dtype)
    target_update = (
        2 * 4 * z.Tb * d + _cross_update(min(MLP_CROSS_CHUNK, z.Tb), width, d, mlp_cross_path, b) if mlp_target else 0
    )
    # The second moment's update and the cross moment's run one after the other, so the hook holds the larger of the
    # two. The float64 and split paths keep their sum, which their GPU rows measured (LLaMA-2-70B widths: 37.3 GiB
    # in the covariance phase, 0.9 GiB above the larger alone, from temporaries this model does not itemise); the
    # centred path, measured on the CPU, takes the larger.
    hook_then_cross = max(mlp_forward, (width + 2 * d) * z.Tb * b + max(update, target_update))
    covariance = Phase(
        "covariance",
        (
            *apply_base,
            pruned,
            c_moment,
            mlp_cross,
            Term(
                "the original group's output on every batch",
                z.S if mlp_target else 0,
                "mlp_target='sequential': one states copy, freed batch by batch",
            ),
            Term(
                "one batch of the wide block, stopped at the down-projection input",
                max(
                    at_down_hook + target_update if mlp_cross_path != "centred" else hook_then_cross,
                    attention_temporaries,
                    # The members run here for the output only when the attention's run did not give it.
                    z.run_outputs() + z.block_forward() if mlp_target and not sequential else 0,
                ),
                "the MLP activations, the masked token copy and the centred float32 chunk"
                + (" and the float32 (g·i)² product" if float64 else "")
                + ("; the target and its chunk" if mlp_target else "")
                + ("; or the members' run for the output" if mlp_target and not sequential else ""),
            ),
        ),
    )
    block = min(width, LEVERAGE_PANEL)
    if float64:
        leverage = 8 * width * width + 3 * 8 * width * block
        nystrom = 8 * (width * d + 2 * keep * d + keep * keep + keep * rest + rest * d)
        if mlp_target:  # `ridge_refit_to_target`: the float64 copy of W_down first, then the kept block's factor
            nystrom = max(8 * width * d + 8 * keep * d, 16 * keep * keep + 4 * 8 * keep * d)
        solve_term = Term(
            "leverage scores: Cholesky factor of C + three column panels"
            if leverage >= nystrom
            else "Nyström correction: kept-block factor, C[K, R] and float64 copies of W_down",
            max(leverage, nystrom),
            "float64; the factor is the size of C",
        )
        solve_terms = (c_moment, solve_term)
    else:
        # The triangle and one panel of L⁻¹ with its square; or, after them, the float64 re-scoring of the channels
        # near the cut (unit vectors, solution, residual and a solve's copy, m columns each) with one panel of C.
        refine = 4 * 8 * width * max_refined(width) + 8 * width * block
        # While a panel is factorised it is also read from C in float64 and cast (12·w·B).
        leverage = 2 * (width * width + width * block) + max(12 * width * block, refine)
        reading = 8 * keep * keep + 8 * keep * d + (4 * width + 12 * keep) * block + 8 * block * d
        kept_solve = 16 * keep * keep + 4 * 8 * keep * d
        with_scatter = max(leverage, reading)
        if c_bytes + with_scatter >= kept_solve:
            solve_terms = (
                c_moment,
                Term(
                    "leverage scores: float32 factor as a triangle + one panel of L⁻¹"
                    if leverage >= reading
                    else "kept blocks: C[K, K] and C[K, R] W_D[R] in float64",
                    with_scatter,
                    "beside the float32 scatter",
                ),
            )
        else:
            solve_terms = (
                Term(
                    "Nyström solve: the factor of C[K, K] + λI and the solve's column-major copy of it, C[K, R] "
                    "W_D[R], the kept rows and the result",
                    kept_solve,
                    "after the scatter is dropped",
                ),
            )
    if mlp_target:  # the cross moment stays; S_K − C_KK W_K (built beside C[K, K]) peaks below the kept solve
        solve_terms = (*solve_terms, mlp_cross)
    # One pass without the cache: the group's original outputs wait for the propagation (they are it).
    reused = mlp_target and not cached and config.calibration_mode == "one_pass" and not prebuilt
    solve_terms = (
        *solve_terms,
        Term("the original group's output, kept to propagate", z.S if reused else 0, "one states copy"),
    )
    solve = Phase("solve", (*apply_base, pruned, *solve_terms))
    attention_solve = Phase(
        "attention_solve",
        (
            *apply_base,
            wide,
            o_moment,
            Term(
                "o_proj input-target cross moment (float64)", 8 * heads_width * d if sequential else 0, "(g·H·d_h) × d"
            ),
            traced,
            Term(
                "the attention solve's temporaries (float64)",
                _attention_solve_bytes(config, g, s.num_heads, s.num_kv_heads, s.head_dim, d, sequential),
                "the kept heads' refit or the KV groups' search, whichever holds more (`_attention_solve_bytes`)",
            ),
        ),
    )
    # Without the o_proj moment (the paper's pruning) nothing is solved for the attention.
    phases = [selection, flatten, head_scoring, *([attention_solve] if needs_o else []), covariance, solve]
    if not cached:
        propagate = Phase(
            "propagate",
            (
                *apply_base,
                Term(
                    "the group's compressed block",
                    0 if prebuilt or reused else s.layer_bytes,
                    "until it replaces its first member" if not prebuilt else "selection='loss': among the candidates",
                ),
                z.run_term(),
            ),
        )
        phases.append(propagate)
    p_layer, p_att, p_mlp, p_norm = s.layer_weights, s.attention_weights, s.mlp_weights, s.norm_weights
    groups = n if g == 2 else math.ceil(n / (g - 1))
    # Up to o_proj (all heads, the attention norm: half the norms), then up to the down projection (pruned heads).
    per_group = g * (p_att - s.o_weights) + p_norm / 2 + p_att + p_norm + g * (p_mlp - s.down_weights)
    # The members' runs for the sequential targets (`member_runs`); reading the cache, one group assumed to end the
    # stack and run them as without it (a bound).
    members = sum(member_runs(s, g, sequential, mlp_target, reads_cache))
    members_end = sum(member_runs(s, g, sequential, mlp_target, False))
    if cached:
        propagation = 0
    elif prebuilt:
        # The candidates' pass runs the original layers 0..L-3 once; the application installs the chosen blocks.
        propagation = (L - 2) * p_layer
    elif config.calibration_mode == "sequential":
        # The compressed block (one layer) runs instead of its g members.
        propagation = L * p_layer - groups * (g - 1) * p_layer
    elif mlp_target:
        # The members' outputs, computed for the MLP's target, are the group's propagation: only kept layers run.
        # n removed layers in `groups` groups have n + groups members (2n with pairs; fewest groups: a bound).
        propagation = (L - n - groups) * p_layer
    else:
        propagation = L * p_layer
    if by_loss:
        # Per merge with G groups: the states once more from the merge on (at most G runs), and each candidate's
        # wide block (g layers) and the groups after it (at most G runs) and one LM head; the first G runs are the
        # states themselves. A bound: merged groups after a candidate are counted as one layer each.
        merges = [L - k for k in range(n)]
        block = 1 if prebuilt else g  # a compressed candidate is one layer wide, a wide block g
        work = L + sum(G + (G - 1) * (block + G) + (G - 1) * s.head_weights / p_layer for G in merges)
        selection_work = fraction * work * p_layer
    else:
        selection_work = (L - 1) * p_layer
    if prebuilt:
        groups = candidates
    ends = 1 if groups else 0
    passes = (selection_work + propagation + groups * per_group + (groups - ends) * members + ends * members_end) / (
        L * p_layer
    )
    notes = []
    if by_loss:
        notes.append("the loss selection's candidate runs are a bound")
    if g != 2:
        notes.append(f"groups of up to {g} layers assumed (max_group_size={config.max_group_size}): a bound")
    if reads_cache:
        notes.append("one merged group is assumed to end the stack, running its members whole (a bound)")
    return phases, passes, g != 2 or by_loss or reads_cache, notes


def _loss_selection_phase(
    z: WorkspaceSizes, n: int, g: int, scored_states: int, fraction: float, candidates: int
) -> Phase:
    """The loss selections (`groups_by_calibration_loss`): the states entering every group on the scored batches and
    one candidate's suffix run, beside the candidates' blocks: with ``"loss"`` every compressed candidate (one layer
    each, built before the search, whose runner stays open), with ``"wide_loss"`` the wide blocks of the merges made
    and of the best candidate, and the candidate being flattened."""
    s = z.shape
    nll = 12 * z.cal.seqlen * s.vocab_size
    if candidates:
        forward = z.block_forward()
        blocks = Term("the compressed candidate groups", candidates * s.layer_bytes, f"{candidates}, one layer each")
        run = Term(
            "the candidate's suffix run",
            scored_states + max(int(z.run_outputs() * fraction) + forward, nll),
            "the suffix's input, run outputs and temporaries, or one row's next-token loss",
        )
        runner = z.runners(1)
    else:
        forward = z.block_forward(g * z.i, g * s.num_heads, g * s.num_kv_heads)
        blocks = Term(
            "wide blocks of the merges made and of the best candidate so far",
            n * g * s.layer_bytes,
            f"{n} wide blocks of {g} layers at the last merge",
        )
        run = Term(
            "the candidate: its members' copies and wide block while built, or its suffix run",
            max(
                2 * g * s.layer_bytes + z.d * z.i * z.b,
                g * s.layer_bytes + scored_states + max(int(z.run_outputs() * fraction) + forward, nll),
            ),
            "flatten as in the flatten phase; or the block, the suffix's input, run outputs and temporaries, or "
            "one row's next-token loss",
        )
        runner = z.runners(1)[1:]
    return Phase(
        "selection",
        (
            z.tokens(),
            *runner,
            Term("layer-0 states on the scored batches", scored_states, "the scoring runner, cut to those batches"),
            Term(
                f"states entering every group ({s.num_layers})", s.num_layers * scored_states, f"fraction {fraction:g}"
            ),
            blocks,
            run,
        ),
    )


def band_size(copy_bytes: int, num_layers: int, config: Any) -> int:
    """How many layers back the similarity pass compares each layer with: every layer when `num_layers` float32
    copies of the calibration states (`copy_bytes` each) fit `similarity_memory_gb`, else the narrowest band the
    greedy selection needs (bounded groups need exactly max_group_size - 1 predecessors; unlimited ones get as many
    as fit, and longer chains are then not formed). One rule for the pass (`similarity.similarity_band`) and for its
    memory and arithmetic models."""
    fits = max(1, int(config.similarity_memory_gb * 2**30 // max(copy_bytes, 1)))
    if fits >= num_layers:
        return num_layers
    return fits if config.max_group_size is None else config.max_group_size - 1


def _auto_band(z: WorkspaceSizes, config: Any, num_layers: int) -> int:
    """`band_size` at the estimate's sizes (one float32 copy of the calibration states is ``z.S32`` bytes)."""
    return band_size(z.S32, num_layers, config)


def member_runs(s: Any, g: int, sequential: bool, mlp_target: bool, cached: bool) -> tuple[float, float]:
    """The weights the members of one group run for the sequential targets, in the head scoring and in the
    covariance: without the selection's cache, with both targets one whole run (the writes and the output), with
    the attention's alone all but the last whole and the last up to its MLP norm, with the MLP's alone a whole run
    in the covariance; with the cache (`FlattenGPTMethod.member_states`), each member up to its MLP norm for the
    attention's, nothing for the MLP's."""
    p_layer, p_att, p_norm = s.layer_weights, s.attention_weights, s.norm_weights
    if cached:
        return (g * (p_att + p_norm / 2) if sequential else 0.0), 0.0
    if mlp_target and sequential:
        return float(g * p_layer), 0.0
    if sequential:
        return (g - 1) * p_layer + p_att + p_norm / 2, 0.0
    return 0.0, (float(g * p_layer) if mlp_target else 0.0)


def selection_cache_holds(z: WorkspaceSizes, config: Any) -> bool:
    """Whether the selection leaves every layer's input for the application (`SelectionCache`): the similarity
    selection, in the one-pass mode, with every layer in its band."""
    L = z.shape.num_layers
    band = config.similarity_band or _auto_band(z, config, L)
    one_pass = config.calibration_mode == "one_pass"
    return band >= L and one_pass and getattr(config, "selection", "similarity") == "similarity"


def cached_member_states(z: WorkspaceSizes, config: Any) -> bool:
    """Whether the sequential targets read the selection's cached states (`FlattenGPTMethod.member_states`): the
    cache is there (`selection_cache_holds`) and a target is sequential."""
    targets = (getattr(config, "attention_target", "parallel"), getattr(config, "mlp_target", "parallel"))
    return selection_cache_holds(z, config) and "sequential" in targets
