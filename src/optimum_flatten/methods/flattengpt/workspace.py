"""FlattenGPT's memory model for `optimum-flatten estimate`: what its selection, flatten, head scoring, covariance
and solves hold at their peaks (`FlattenGPTMethod.workspace`). Kept beside the method in a module of its own: it is
as long as the method's phases are many, and it changes when they do.

Laid out as a table: `FlattenGPTSizes` computes once what the phases share (widths, precisions, the terms several
phases hold), and each phase is one function listing its terms, in the order `flattengpt_workspace` runs them."""

from __future__ import annotations

import math
from typing import Any

from ...calibration.precision import SPLIT_GRAM_BAND
from ...compression.workspace import LEVERAGE_PANEL, Phase, Term, WorkspaceModel, WorkspaceSizes
from ...ops.ridge import max_refined
from ...options.methods.flattengpt import resolve_covariance_dtype
from .choices import (
    MLP_CROSS_CHUNK,
    auto_band,
    cross_path,
    group_size,
    member_runs,
    selection_cache_holds,
)
from .temporaries import _attention_solve_bytes, _cross_update


def flattengpt_workspace(z: WorkspaceSizes, n: int, config: Any) -> WorkspaceModel:
    """FlattenGPT: a similarity pass, then per merged group a wide block, two statistics and their solves.

    The phases, in the order they run, are one function each below (`FlattenGPTSizes` holds what they share); each
    one's docstring says what it holds at its peak. The application reuses the selection's runner (one S), and each
    compressed block takes its first member's place as soon as it is built (and, without the selection's cache,
    propagated): no block is held beside the one it replaces.

    g is max_group_size (with None, the worst case n + 1); n groups at most (exactly n with pairs).
    Cost (`stack_passes`): the selection runs L − 1 layers; without the cache the application runs every layer once
    more (the members of a group too, on the original model's states); per group the wide block runs twice, each
    time only up to the statistic: all heads up to o_proj, then the pruned attention and the MLP up to the down
    projection.
    """
    f = FlattenGPTSizes(z, n, config)
    selection = _loss_selection_phase(z, n, f.g, f.scored_states, f.fraction, f.candidates) if f.by_loss else None
    selection = selection or similarity_phase(f)
    solve, reused = solve_phase(f)
    # Without the o_proj moment (the paper's pruning) nothing is solved for the attention.
    phases = [
        selection,
        flatten_phase(f, selection),
        head_scoring_phase(f),
        *([attention_solve_phase(f)] if f.needs_o else []),
        covariance_phase(f),
        solve,
        *([] if f.cached else [propagate_phase(f, reused)]),
    ]
    notes = []
    if f.by_loss:
        notes.append("the loss selection's candidate runs are a bound")
    if f.g != 2:
        notes.append(f"groups of up to {f.g} layers assumed (max_group_size={config.max_group_size}): a bound")
    if f.reads_cache:
        notes.append("one merged group is assumed to end the stack, running its members whole (a bound)")
    if config.covariance_dtype == "auto" and f.split:
        notes.append(
            "covariance_dtype='auto' taken as on a CUDA device (the bfloat16 split, a float64 scatter); a CPU run "
            "takes float32 and holds less (a bound there; pass covariance_dtype='float32' for a CPU's figure)"
        )
    return phases, stack_passes(f), f.g != 2 or f.by_loss or f.reads_cache, notes


class FlattenGPTSizes:
    """What the phases of one FlattenGPT request share: the group size, the widths of the wide block's statistics
    and their precisions, which selection and targets run, and the terms several phases hold. One place computes
    them so that each phase below reads as the list of what it holds."""

    def __init__(self, z: WorkspaceSizes, n: int, config: Any) -> None:
        self.z, self.n, self.config = z, n, config
        s = self.s = z.shape
        L = self.L = s.num_layers
        kind = getattr(config, "selection", "similarity")
        self.by_loss = kind in ("loss", "wide_loss")
        # selection="loss" compresses every run of 2..max_group_size layers before choosing: each size occurs.
        self.prebuilt = kind == "loss"
        g = self.g = group_size(n, L, config)
        self.candidates = sum(L - size + 1 for size in range(2, g + 1)) if self.prebuilt else 0
        self.band = config.similarity_band or auto_band(z, config, L)
        self.cached = selection_cache_holds(z, config)
        scored = min(config.scoring_batches or z.cal.batches, z.cal.batches) if self.by_loss else 0
        self.fraction = min(1.0, scored * z.cal.batch_size / z.cal.nsamples)
        self.scored_states = int(z.S * self.fraction)
        self.width = g * z.i  # the wide MLP: the statistic C is width x width
        self.heads_width = g * s.num_heads * s.head_dim
        self.keep, self.rest = z.i, self.width - z.i
        # "auto" as the run on a GPU resolves it (a bfloat16 model is compressed on one; on a CPU it takes float32).
        self.precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, self.width)
        self.heads_precision = resolve_covariance_dtype(config.covariance_dtype, s.dtype, True, self.heads_width)
        self.float64 = self.precision == "float64"
        # covariance_dtype="bfloat16": the float32 path's solve on a float64 scatter of split bfloat16 products.
        self.split = self.precision == "bfloat16"
        self.needs_o = config.attention_correction or config.head_selection == "reconstruction"
        self.c_bytes = (8 if self.float64 or self.split else 4) * self.width * self.width
        self.sequential = getattr(config, "attention_target", "parallel") == "sequential"
        self.mlp_target = getattr(config, "mlp_target", "parallel") == "sequential"  # refused without mlp_correction
        self.reads_cache = self.cached and (self.sequential or self.mlp_target)  # `cached_member_states`

    def wide(self) -> Term:
        s = self.s
        return Term(
            "wide block",
            self.g * (s.attention_weights + s.mlp_weights) * self.z.b + s.norm_weights * self.z.b,
            f"the {self.g} members side by side",
        )

    def pruned(self) -> Term:
        s = self.s
        return Term(
            "wide block with its pruned attention",
            (s.attention_weights + self.g * s.mlp_weights) * self.z.b + s.norm_weights * self.z.b,
            "the kept heads and the g members' MLP channels",
        )

    def o_moment(self) -> Term:
        return Term(
            "o_proj input second moment (float64)",
            8 * self.heads_width * self.heads_width if self.needs_o else 0,
            "(g·H·d_h)², for the attention refit; freed before the MLP statistics",
        )

    def o_cross(self) -> Term:
        return Term(
            "o_proj input-target cross moment (float64)",
            8 * self.heads_width * self.z.d if self.sequential else 0,
            "(g·H·d_h) × d",
        )

    def c_moment(self) -> Term:
        return Term(
            f"MLP second moment C ({self.precision})",
            self.c_bytes,
            "(g·i)², the ridge statistics"
            + ("" if self.float64 else ": a centred scatter, the mean part kept in float64"),
        )

    def mlp_cross(self) -> Term:
        return Term(
            "down input-target cross moment (float64)", 8 * self.width * self.z.d if self.mlp_target else 0, "(g·i) × d"
        )

    def traced(self) -> Term:
        """Both sequential targets: the members' run for the writes goes on to the group's output, which then waits
        for the MLP's target through the head scoring and the attention solve (one run of the members, not two)."""
        return Term(
            "the original group's output, traced with the writes",
            self.z.S if self.mlp_target and (self.sequential or self.reads_cache) else 0,
            "both sequential targets, or the MLP's read from the cache: one states copy, kept for the MLP's target",
        )

    def apply_base(self) -> list[Term]:
        """What every phase of the application holds: the runner, the loss selection's leftovers, the selection's
        cache and the states entering the group.

        The **cache**: with the whole stack in the similarity band and `calibration_mode="one_pass"`, the unit copies
        and norms of the layers that start a merged group stay after the plan (n of them, fewer as groups are done),
        and each group's input is rebuilt from them (S): the application runs no layer of the original model again.
        With a sequential target the copies of the layers it reads stay too (the later members' inputs and the
        group's output: g more per group). Otherwise the states entering the group (S) come from propagating the
        original layers."""
        z, g, n = self.z, self.g, self.n
        # Per group its first layer's input, and reading the cache, its later members' and the layer's after it.
        units = 1 + ((g - 1 if self.sequential else 0) + (1 if self.mlp_target else 0) if self.reads_cache else 0)
        return [
            z.tokens(),
            *z.runners(1),
            Term(
                "the loss selection's runner: layer-0 states on the scored batches",
                0 if self.prebuilt else self.scored_states,
                "the context keeps each runner it opened",
            ),
            Term(
                "compressed candidate groups built so far",
                max(self.candidates - 1, 0) * self.s.layer_bytes,
                "selection='loss': every candidate group compressed before choosing, one layer each",
            ),
            Term(
                "cached inputs of the merged groups' first layers"
                + (" and of the layers their sequential targets read" if self.reads_cache else ""),
                min((n - 1) * units, self.L) * (z.S32 + 8 * z.N) if self.cached else 0,
                "unit copies and float64 norms from the selection, fewer per group done",
            ),
            Term(
                "states entering the group", z.S, "rebuilt from the cache" if self.cached else "the propagated stream"
            ),
        ]


def similarity_phase(f: FlattenGPTSizes) -> Phase:
    """selection: the runner (S) and the states entering and leaving the layer being run (S + run outputs), plus
    `band` float32 unit-normalised copies of the states (the similarity window; the automatic band is the whole stack
    when L copies fit `similarity_memory_gb`, else max_group_size − 1), and, when the last layer is normalised, the
    copies of its earlier batches and one batch's float64 temporaries (20·T_b·d). With the whole stack in the band,
    the float64 token norms of every layer (8·N each) are kept too (the cache's, `FlattenGPTSizes.apply_base`)."""
    z, L = f.z, f.L
    copies = min(f.band, L - 1)
    normalise = z.S32 * (z.cal.batches - 1) // z.cal.batches + 20 * z.Tb * z.d
    return Phase(
        "selection",
        (
            z.tokens(),
            *z.runners(1),
            Term("states entering the layer", z.S, "one boundary of the stack"),
            Term(f"float32 unit copies in the similarity band ({copies})", copies * z.S32, f"band = {f.band}"),
            Term("float64 token norms of every layer", L * 8 * z.N if f.band >= L else 0, "the cache's norms"),
            Term(
                "largest per-batch work: a layer run, or normalising the last layer",
                max(z.run_outputs() + z.block_forward(), normalise),
                "run outputs + block temporaries, or one more float32 copy + float64 temporaries",
            ),
        ),
    )


def flatten_phase(f: FlattenGPTSizes, selection: Phase) -> Phase:
    """flatten: the states entering the group, the group's member copies (g layers) and the wide block (g layers),
    which starts as a copy of the first member whose weights are replaced one by one (its down projection, d·i, is
    the last to go). With ``selection="wide_loss"`` the selection builds every candidate's wide block under the same
    phase name, beside its own states: the larger of the two."""
    z, s = f.z, f.s
    flatten = Phase(
        "flatten",
        (
            *f.apply_base(),
            Term(
                "member copies and the wide block, with the last weight of the copy it starts from",
                2 * f.g * s.layer_bytes + z.d * z.i * z.b,
                "the wide block starts as a copy of the first member whose weights are replaced one by one",
            ),
        ),
    )
    if f.by_loss and not f.prebuilt and selection.bytes > flatten.bytes:
        return Phase("flatten", selection.terms)
    return flatten


def head_scoring_phase(f: FlattenGPTSizes) -> Phase:
    """head_scoring: the wide block (g layers); the o_proj input second moment (float64, (g·H·d_h)²); the wide block
    runs each batch only up to its o_proj input, where it holds q, k, v and the attention output while the head
    scores take two float64 copies of that input (16·T_b·g·H·d_h) and the moment its own update.

    With `attention_target="sequential"` also the members' attention writes (float32, S32), built by running the
    members in turn (a member's outputs, S, held meanwhile), then read batch by batch beside the wide block's o_proj
    input into their float64 cross moment with it ((g·H·d_h)·d), a chunk at a time. With `mlp_target="sequential"`
    as well (the defaults) that run goes on through the last member, and the group's output it leaves (S) is held
    from then on for the MLP's target. Reading the selection's cache, the later members' inputs ((g − 1)·S) are held
    while each member's attention runs for its write. The moment's update and the cross moment's run one after the
    other: the centred path takes the larger, the others keep the sum their GPU rows measured (as the MLP's
    statistics do, `covariance_phase`)."""
    z, s, hw = f.z, f.s, f.heads_width
    at_o_hook = (z.d + 2 * hw + 2 * f.g * s.num_kv_heads * s.head_dim) * z.Tb * z.b
    head_hook = max(16 * z.Tb * hw, z.moment_update(hw, f.heads_precision == "bfloat16") if f.needs_o else 0)
    heads_cross = cross_path(f.heads_precision, s.dtype)
    cross_update = _cross_update(min(4096, z.Tb), hw, z.d, heads_cross, z.b) if f.sequential else 0
    return Phase(
        "head_scoring",
        (
            *f.apply_base(),
            f.wide(),
            f.o_moment(),
            Term(
                "the members' sequential attention writes (float32)",
                z.S32 if f.sequential else 0,
                "attention_target='sequential': one states copy, freed batch by batch",
            ),
            f.o_cross(),
            f.traced(),
            Term(
                "the later members' inputs, rebuilt from the cache",
                (f.g - 1) * z.S if f.reads_cache and f.sequential else 0,
                "each member's attention runs on its own input: freed once the writes are in",
            ),
            Term(
                "one batch of the wide block, stopped at the o_proj input",
                max(
                    at_o_hook
                    + (head_hook + cross_update if heads_cross != "centred" else max(head_hook, cross_update)),
                    z.S + z.block_forward() if f.sequential else 0,
                ),
                "q, k, v, attention output; float64 head scores; the moment's token copies and product"
                + (
                    "; or the members' run for the writes: a member's outputs and one batch's temporaries"
                    if f.sequential
                    else ""
                ),
            ),
        ),
    )


def attention_solve_phase(f: FlattenGPTSizes) -> Phase:
    """attention_solve (the writes are freed; the moments stay, and with both sequential targets the group's
    output): the kept heads' refit, or the search for the KV groups and then the refit, in float64
    (`_attention_solve_bytes`)."""
    s = f.s
    return Phase(
        "attention_solve",
        (
            *f.apply_base(),
            f.wide(),
            f.o_moment(),
            f.o_cross(),
            f.traced(),
            Term(
                "the attention solve's temporaries (float64)",
                _attention_solve_bytes(f.config, f.g, s.num_heads, s.num_kv_heads, s.head_dim, f.z.d, f.sequential),
                "the kept heads' refit or the KV groups' search, whichever holds more (`_attention_solve_bytes`)",
            ),
        ),
    )


def covariance_phase(f: FlattenGPTSizes) -> Phase:
    """covariance (the o_proj moment is freed before it; the wide block has its pruned attention): the MLP statistic
    C — `covariance_dtype="float32"`: a float32 scatter 4·(g·i)², each batch adding, in chunks of 4096 tokens, a
    centred float32 copy straight into it; "float64": 8·(g·i)² and one float32 (g·i)² product per batch — and the
    block's MLP activations up to the down projection (which does not run): act(gate), up and their product while it
    is computed, then the product with the update's masked token copy and centred chunk.

    With `mlp_target="sequential"` it also holds the original group's output (S, built by running the members whole
    unless the attention's run gave it) and the float64 cross moment of the down input with the target ((g·i)·d),
    each batch adding its float32 target (the group's output less the MLP input residual) and one chunk's copies
    (`_cross_update`). The two moments' updates run one after the other, so the hook holds the larger of the two.
    The float64 and split paths keep their sum, which their GPU rows measured (LLaMA-2-70B widths: 37.3 GiB in the
    covariance phase, 0.9 GiB above the larger alone, from temporaries this model does not itemise); the centred
    path, measured on the CPU, takes the larger."""
    z, s, width, b, d = f.z, f.s, f.width, f.z.b, f.z.d
    chunk = min(4096, z.Tb)
    upcast = 4 if b != 4 else 0
    # The masked token copy, then per chunk its float64 column sum or its float32 centred copy (and the cast to it).
    update = z.moment_update(width) if f.float64 else z.Tb * width * b + chunk * width * max(8, 4 + upcast)
    if f.split:  # the masked copy; per chunk its centred float32 copy, [hi; hi; lo; hi] and y − hi, a band's product
        update = z.Tb * width * b + chunk * width * (4 + 4 * 2 + 4) + 4 * width * min(SPLIT_GRAM_BAND, width)
    # The MLP peaks at act(gate), up and their product; at the hook only the product (the down input) is left.
    mlp_forward = ((3 if s.gated_mlp else 2) * width + 2 * d) * z.Tb * b
    at_down_hook = max(mlp_forward, (width + 2 * d) * z.Tb * b + update)
    mlp_cross_path = cross_path(f.precision, s.dtype)
    target_update = (
        2 * 4 * z.Tb * d + _cross_update(min(MLP_CROSS_CHUNK, z.Tb), width, d, mlp_cross_path, b) if f.mlp_target else 0
    )
    hook_then_cross = max(mlp_forward, (width + 2 * d) * z.Tb * b + max(update, target_update))
    mlp_target, sequential = f.mlp_target, f.sequential
    return Phase(
        "covariance",
        (
            *f.apply_base(),
            f.pruned(),
            f.c_moment(),
            f.mlp_cross(),
            Term(
                "the original group's output on every batch",
                z.S if mlp_target else 0,
                "mlp_target='sequential': one states copy, freed batch by batch",
            ),
            Term(
                "one batch of the wide block, stopped at the down-projection input",
                max(
                    at_down_hook + target_update if mlp_cross_path != "centred" else hook_then_cross,
                    z.block_forward(1, s.num_heads, s.num_kv_heads),
                    # The members run here for the output only when the attention's run did not give it.
                    z.run_outputs() + z.block_forward() if mlp_target and not sequential else 0,
                ),
                "the MLP activations, the masked token copy and the centred float32 chunk"
                + (" and the float32 (g·i)² product" if f.float64 else "")
                + ("; the target and its chunk" if mlp_target else "")
                + ("; or the members' run for the output" if mlp_target and not sequential else ""),
            ),
        ),
    )


def solve_phase(f: FlattenGPTSizes) -> tuple[Phase, bool]:
    """solve, and whether the group's original outputs are kept to propagate (in the one-pass mode without the
    cache they are the group's propagation: they stay through the solve and the members do not run again).

    With `mlp_target="sequential"` the solve keeps the down input's cross moment (S_K − C_KK W_K, built beside
    C[K, K] and W_K, stays under the kept solve's two factors). The solve's own temporaries: `_mlp_solve_terms`."""
    solve_terms = _mlp_solve_terms(f)
    if f.mlp_target:  # the cross moment stays; S_K − C_KK W_K (built beside C[K, K]) peaks below the kept solve
        solve_terms = (*solve_terms, f.mlp_cross())
    reused = f.mlp_target and not f.cached and f.config.calibration_mode == "one_pass" and not f.prebuilt
    solve_terms = (
        *solve_terms,
        Term("the original group's output, kept to propagate", f.z.S if reused else 0, "one states copy"),
    )
    return Phase("solve", (*f.apply_base(), f.pruned(), *solve_terms)), reused


def _mlp_solve_terms(f: FlattenGPTSizes) -> tuple[Term, ...]:
    """The MLP solve's statistic and temporaries (w = g·i channels, k = i kept, r = w − k dropped, B = 1024-channel
    panels). float64: C, its full factor and three (w × B) float64 panels, or the Nyström correction (the k × k factor
    and the k × r block of C, float64 copies of W_down), whichever is larger. float32, the largest of:
    (a) the leverage scores: the scatter, the factor's lower-triangular panels in float32 (4·(w² + w·B)/2), one panel
    read from C in float64 and cast (12·w·B; one panel of L⁻¹ and its square are less), or the float64 re-scoring of
    the m channels nearest the cut (4 float64 w × m blocks and a float64 panel of C, m = `max_refined(w)` at most: a
    bound); (b) reading the kept blocks: the scatter, C[K, K] and C[K, R] W_D[R] in float64 (8·k² + 8·k·d) and one
    chunk's copies ((4·w + 12·k)·B + 8·B·d); (c) after the scatter is dropped: the float64 Cholesky factor of
    C[K, K] + λI (C[K, K] itself is dropped once factorised) and the column-major copy of it that the solve makes
    (8·k² each), C[K, R] W_D[R], the float64 kept rows, the solve and their sum (4 · 8·k·d)."""
    width, keep, rest, d = f.width, f.keep, f.rest, f.z.d
    block = min(width, LEVERAGE_PANEL)
    if f.float64:
        leverage = 8 * width * width + 3 * 8 * width * block
        nystrom = 8 * (width * d + 2 * keep * d + keep * keep + keep * rest + rest * d)
        if f.mlp_target:  # `ridge_refit_to_target`: the float64 copy of W_down first, then the kept block's factor
            nystrom = max(8 * width * d + 8 * keep * d, 16 * keep * keep + 4 * 8 * keep * d)
        solve_term = Term(
            "leverage scores: Cholesky factor of C + three column panels"
            if leverage >= nystrom
            else "Nyström correction: kept-block factor, C[K, R] and float64 copies of W_down",
            max(leverage, nystrom),
            "float64; the factor is the size of C",
        )
        return (f.c_moment(), solve_term)
    # The triangle and one panel of L⁻¹ with its square; or, after them, the float64 re-scoring of the channels
    # near the cut (unit vectors, solution, residual and a solve's copy, m columns each) with one panel of C.
    refine = 4 * 8 * width * max_refined(width) + 8 * width * block
    # While a panel is factorised it is also read from C in float64 and cast (12·w·B).
    leverage = 2 * (width * width + width * block) + max(12 * width * block, refine)
    reading = 8 * keep * keep + 8 * keep * d + (4 * width + 12 * keep) * block + 8 * block * d
    kept_solve = 16 * keep * keep + 4 * 8 * keep * d
    with_scatter = max(leverage, reading)
    if f.c_bytes + with_scatter >= kept_solve:
        return (
            f.c_moment(),
            Term(
                "leverage scores: float32 factor as a triangle + one panel of L⁻¹"
                if leverage >= reading
                else "kept blocks: C[K, K] and C[K, R] W_D[R] in float64",
                with_scatter,
                "beside the float32 scatter",
            ),
        )
    return (
        Term(
            "Nyström solve: the factor of C[K, K] + λI and the solve's column-major copy of it, C[K, R] "
            "W_D[R], the kept rows and the result",
            kept_solve,
            "after the scatter is dropped",
        ),
    )


def propagate_phase(f: FlattenGPTSizes, reused: bool) -> Phase:
    """propagate (without the cache): the states entering and leaving the layer, and the group's compressed block
    until it replaces its first member (none when the group's outputs are reused: only kept layers run)."""
    return Phase(
        "propagate",
        (
            *f.apply_base(),
            Term(
                "the group's compressed block",
                0 if f.prebuilt or reused else f.s.layer_bytes,
                "until it replaces its first member" if not f.prebuilt else "selection='loss': among the candidates",
            ),
            f.z.run_term(),
        ),
    )


def stack_passes(f: FlattenGPTSizes) -> float:
    """The layers run, in stack passes: the selection's, the propagation's, and per group the wide block's two runs
    up to its statistics and the members' runs for the sequential targets (`member_runs`); reading the cache, one
    group is assumed to end the stack and run them as without it (a bound)."""
    s, g, n, L, config = f.s, f.g, f.n, f.L, f.config
    p_layer, p_att, p_mlp, p_norm = s.layer_weights, s.attention_weights, s.mlp_weights, s.norm_weights
    groups = n if g == 2 else math.ceil(n / (g - 1))
    # Up to o_proj (all heads, the attention norm: half the norms), then up to the down projection (pruned heads).
    per_group = g * (p_att - s.o_weights) + p_norm / 2 + p_att + p_norm + g * (p_mlp - s.down_weights)
    members = sum(member_runs(s, g, f.sequential, f.mlp_target, f.reads_cache))
    members_end = sum(member_runs(s, g, f.sequential, f.mlp_target, False))
    if f.cached:
        propagation = 0
    elif f.prebuilt:
        # The candidates' pass runs the original layers 0..L-3 once; the application installs the chosen blocks.
        propagation = (L - 2) * p_layer
    elif config.calibration_mode == "sequential":
        # The compressed block (one layer) runs instead of its g members.
        propagation = L * p_layer - groups * (g - 1) * p_layer
    elif f.mlp_target:
        # The members' outputs, computed for the MLP's target, are the group's propagation: only kept layers run.
        # n removed layers in `groups` groups have n + groups members (2n with pairs; fewest groups: a bound).
        propagation = (L - n - groups) * p_layer
    else:
        propagation = L * p_layer
    if f.by_loss:
        # Per merge with G groups: the states once more from the merge on (at most G runs), and each candidate's
        # wide block (g layers) and the groups after it (at most G runs) and one LM head; the first G runs are the
        # states themselves. A bound: merged groups after a candidate are counted as one layer each.
        merges = [L - k for k in range(n)]
        block = 1 if f.prebuilt else g  # a compressed candidate is one layer wide, a wide block g
        work = L + sum(G + (G - 1) * (block + G) + (G - 1) * s.head_weights / p_layer for G in merges)
        selection_work = f.fraction * work * p_layer
    else:
        selection_work = (L - 1) * p_layer
    if f.prebuilt:
        groups = f.candidates
    ends = 1 if groups else 0
    return (selection_work + propagation + groups * per_group + (groups - ends) * members + ends * members_end) / (
        L * p_layer
    )


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
