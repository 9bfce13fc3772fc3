"""MLP channel selection by ridge leverage and the Nyström correction of the down projection (FlattenGPT §3.3).

C is the second moment of the activations entering W_down (channels × channels). Channels are kept by ridge
leverage s = diag(C (C + λI)⁻¹), and the kept rows of W_D (channels × hidden) absorb what the dropped channels
contributed:

    W_D' = S_kᵀ W_D + (S_kᵀ C S_k + λI)⁻¹ S_kᵀ C (I − S_k S_kᵀ) W_D
         = W_D[K] + (C[K,K] + λI)⁻¹ C[K,R] W_D[R]

which is the ridge least-squares fit of the dropped channels' output from the kept channels. Every inverse is a
Cholesky solve in float64 (with jitter if needed), never an explicit inverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..utils import flops


def default_ridge_lambda(second_moment: torch.Tensor, ratio: float) -> float:
    """λ = ratio × mean eigenvalue of C (trace / dim); scale-free, so one ratio fits every layer."""
    c = second_moment.double()
    return float(ratio) * float(torch.trace(c)) / c.shape[0]


def cholesky_shifted_in_place(
    matrix: torch.Tensor, shift: float, jitters: Iterable[float]
) -> tuple[torch.Tensor, float, int] | None:
    """(factor, jitter, attempt) of the Cholesky factor of `matrix + (shift + jitter)·I` for the first of `jitters`
    that factorises, or None when none does.

    The shift is added to the diagonal of `matrix` in place and the saved diagonal put back afterwards (bit for bit,
    also on error), so the only n × n allocation is the factor: the statistics are the largest tensors a solve holds.
    """
    diagonal = matrix.diagonal()
    saved = diagonal.clone()
    try:
        for attempt, jitter in enumerate(jitters, start=1):
            diagonal.copy_(saved).add_(shift + jitter)
            flops.record(flops.cholesky(matrix.shape[0]), flops.precision_of(matrix.dtype), "factorisation")
            factor, info = torch.linalg.cholesky_ex(matrix)
            flops.record_host_reads(1)
            if int(info) == 0:
                return factor, jitter, attempt
            del factor
    finally:
        diagonal.copy_(saved)
    return None


def _shifted_cholesky(matrix: torch.Tensor, shift: float) -> tuple[torch.Tensor, float]:
    """Cholesky factor of `matrix + shift·I`, and the shift actually used.

    If rounding made the matrix indefinite, a growing jitter (relative to its mean diagonal) is added to the shift;
    callers that need the exact shift (the leverage formula) read it back. In place, see `cholesky_shifted_in_place`.
    """
    scale = float(matrix.diagonal().abs().mean().clamp_min(1e-30))
    flops.record_host_reads(1)
    found = cholesky_shifted_in_place(matrix, shift, [0.0] + [scale * 10.0**exponent for exponent in range(-12, 0)])
    if found is None:
        raise torch.linalg.LinAlgError(
            "matrix is not positive definite even with jitter; is the calibration data empty?"
        )
    factor, jitter, _ = found
    return factor, shift + jitter


def ridge_leverage_scores(second_moment: torch.Tensor, lam: float, block_size: int = 1024) -> torch.Tensor:
    """s = diag(C (C + λI)⁻¹), in float64. Scores lie in [0, 1) and sum to the effective dimension of C.

    Since C (C + λI)⁻¹ = I − λ (C + λI)⁻¹, only the diagonal of (C + λI)⁻¹ = L⁻ᵀ L⁻¹ is needed: entry i is the
    squared norm of column i of L⁻¹, which is zero above row i. Columns are solved in blocks against the trailing
    triangle only, so the cost is n³/3 after the Cholesky factorisation (a full solve against C costs 2n³) and
    the extra memory one (n × block) panel instead of another n × n matrix.
    """
    c = second_moment.double()  # no copy when it already is (the statistics are float64)
    n = c.shape[0]
    factor, shift = _shifted_cholesky(c, lam)
    inverse_diagonal = torch.empty(n, dtype=c.dtype, device=c.device)
    for start in range(0, n, block_size):
        stop = min(n, start + block_size)
        panel = torch.zeros(n - start, stop - start, dtype=c.dtype, device=c.device)
        panel.diagonal().fill_(1.0)
        flops.record(flops.triangular_solve(n - start, stop - start), flops.precision_of(c.dtype), "factorisation")
        columns = torch.linalg.solve_triangular(factor[start:, start:], panel, upper=False)
        inverse_diagonal[start:stop] = columns.square().sum(dim=0)
    return (1.0 - shift * inverse_diagonal).clamp_(min=0.0)


def nystrom_down_correction(
    second_moment: torch.Tensor, down_rows: torch.Tensor, keep: torch.Tensor, lam: float
) -> torch.Tensor:
    """The corrected kept rows of W_D (channels × hidden layout), in float64.

    Args:
        second_moment: (n, n) C of the activations entering the down projection.
        down_rows: (n, hidden) W_D, row i being what channel i writes to the residual stream.
        keep: indices of the k kept channels.
        lam: ridge λ.

    Returns:
        (k, hidden) float64 corrected rows for the kept channels, in the order of `keep`.
    """
    c = second_moment.double()
    w = down_rows.double()
    n = c.shape[0]
    keep = torch.as_tensor(keep, dtype=torch.long, device=c.device)
    dropped_mask = torch.ones(n, dtype=torch.bool, device=c.device)
    dropped_mask[keep] = False
    dropped = torch.nonzero(dropped_mask).flatten()
    kept_rows = w[keep]
    if dropped.numel() == 0:
        return kept_rows.clone()
    factor = _shifted_cholesky(c[keep[:, None], keep], lam)[0]
    k, hidden = keep.numel(), w.shape[1]
    flops.record(flops.product(k, dropped.numel(), hidden), "float64")
    flops.record(flops.cholesky_solve(k, hidden), "float64", "factorisation")
    return kept_rows + torch.cholesky_solve(c[keep[:, None], dropped] @ w[dropped], factor)


def ridge_reconstruction_error(
    second_moment: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor, lam: float
) -> float:
    """E‖a W − a_K W'‖² after the Nyström correction W' of the kept rows, per token (float64).

    With Δ = (C_KK + λI)⁻¹ C_KR W_R the correction, the error is
    tr(W_Rᵀ C_RR W_R) − 2 tr(Δᵀ C_KR W_R) + tr(Δᵀ C_KK Δ): what the dropped rows wrote that the kept rows cannot
    reproduce. Used to compare candidate subsets (e.g. which KV groups to keep) without running the model.
    """
    c = second_moment.double()
    w = rows.double()
    keep = torch.as_tensor(keep, dtype=torch.long, device=c.device)
    dropped_mask = torch.ones(c.shape[0], dtype=torch.bool, device=c.device)
    dropped_mask[keep] = False
    dropped = torch.nonzero(dropped_mask).flatten()
    if dropped.numel() == 0:
        return 0.0
    w_r = w[dropped]
    c_kk = c[keep[:, None], keep]
    cross = c[keep[:, None], dropped] @ w_r  # C_KR W_R
    delta = torch.cholesky_solve(cross, _shifted_cholesky(c_kk, lam)[0])
    full = torch.trace(w_r.T @ c[dropped[:, None], dropped] @ w_r)
    k, r, hidden = keep.numel(), dropped.numel(), w.shape[1]
    # C_KR W_R, the solve, Wᵣᵀ C_RR and its product with W_R, C_KK Δ.
    products = flops.product(k, r, hidden) + flops.product(hidden, r, r) + flops.product(hidden, r, hidden)
    flops.record(products + flops.product(k, k, hidden), "float64")
    flops.record(flops.cholesky_solve(k, hidden), "float64", "factorisation")
    flops.record_host_reads(1)
    return float(full - 2 * (delta * cross).sum() + (delta * (c_kk @ delta)).sum())


def ridge_refit_to_target(
    second_moment: torch.Tensor, cross: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor, lam: float
) -> torch.Tensor:
    """The kept rows W' minimising E‖t − a_K W'‖² + λ‖W' − W_K‖² for an arbitrary target t, in float64.

    The Nyström correction is the case t = a W (the pruned layer's own output); a target that is not a function of
    a — what the members of a merged group wrote in the original stack, each on its own input — needs the cross
    moment S = E[a tᵀ] as well. The normal equations (C_KK + λI) W' = S_K + λ W_K give
    W' = W_K + (C_KK + λI)⁻¹ (S_K − C_KK W_K); with S = C W the bracket is C_KR W_R, Nyström's.

    Args:
        second_moment: (n, n) C = E[a aᵀ] of the inputs a of the refitted projection.
        cross: (n, hidden) S = E[a tᵀ] over the same tokens (the target less any bias the projection keeps).
        rows: (n, hidden) W, row i being what input channel i writes; the ridge pulls towards its kept rows.
        keep: indices of the k kept input channels.
        lam: ridge λ.

    Returns:
        (k, hidden) float64 refitted rows, in the order of `keep`.
    """
    c = second_moment.double()
    keep = torch.as_tensor(keep, dtype=torch.long, device=c.device)
    kept_rows = rows.double()[keep]
    c_kk = c[keep[:, None], keep]
    rhs = cross.double()[keep] - c_kk @ kept_rows
    k, hidden = keep.numel(), kept_rows.shape[1]
    flops.record(flops.product(k, k, hidden), "float64")
    flops.record(flops.cholesky_solve(k, hidden), "float64", "factorisation")
    return kept_rows + torch.cholesky_solve(rhs, _shifted_cholesky(c_kk, lam)[0])


def ridge_target_error(
    second_moment: torch.Tensor,
    cross: torch.Tensor,
    target_energy: float,
    rows: torch.Tensor,
    keep: torch.Tensor,
    lam: float,
) -> float:
    """E‖t − a_K W'‖² per token after `ridge_refit_to_target` (float64): E‖t‖² − 2 tr(W'ᵀ S_K) + tr(W'ᵀ C_KK W').

    `target_energy` is E‖t‖² over the same tokens. Compares candidate subsets (which KV groups to keep) against a
    target that the full projection need not reproduce exactly, without running the model.
    """
    c = second_moment.double()
    keep = torch.as_tensor(keep, dtype=torch.long, device=c.device)
    refit = ridge_refit_to_target(c, cross, rows, keep, lam)
    c_kk = c[keep[:, None], keep]
    flops.record(flops.product(keep.numel(), keep.numel(), refit.shape[1]), "float64")
    flops.record_host_reads(1)
    return float(target_energy - 2 * (refit * cross.double()[keep]).sum() + (refit * (c_kk @ refit)).sum())


# ------------------------------------------------------------------------- blocked path, for statistics too big to copy
def ridge_leverage_scores_packed(
    columns: Callable[[int, int], torch.Tensor],
    dim: int,
    lam: float,
    dtype: torch.dtype = torch.float32,
    block_size: int = 1024,
    refine_top_k: int | None = None,
) -> torch.Tensor:
    """s = diag(C (C + λI)⁻¹) (float64 result) from the column panels of C, with a factor stored as a triangle only.

    `columns(start, stop)` returns C[start:, start:stop] (any float dtype). The Cholesky factor of C + λI is built
    left-looking, one column panel at a time, and kept as its lower-triangular panels (dim²/2 entries instead of the
    dim² of a full factor); the diagonal of (C + λI)⁻¹ then comes from blocked forward substitution against the
    identity, one column panel of L⁻¹ at a time. With `dtype=float32` the factor is a quarter of a float64 one: at
    LLaMA-2-70B's merged MLP (57,344 channels) 6.1 GiB instead of 24.5. The leverage scores only rank the channels;
    float32 moves them by about cond(C + λI) · 6e-8, and λ = ratio × mean eigenvalue bounds that condition number
    by 1 + dim / ratio (tested against the float64 path in tests/ops/test_ridge_blocked.py).
    Like `_shifted_cholesky`, a factorisation that fails is retried with a growing jitter added to λ.

    `refine_top_k=k` makes the ranking float64's where it matters: the channels whose low-precision score lies
    within that error bound (8 · (1 + trace(C)/λ) · machine epsilon) of the k-th largest — those whose side of the
    cut rounding could flip, at most `max_refined(dim)` of them, the nearest first — are re-scored in float64 by
    iterative refinement: solves with the low-precision factor, residuals with C read in float64 panels.
    """
    scale = None
    for jitter_exponent in [None, *range(-12, 0)]:
        if jitter_exponent is None:
            shift = lam
        else:
            if scale is None:
                scale = _mean_abs_diagonal(columns, dim, block_size)
            shift = lam + scale * 10.0**jitter_exponent
        panels = _packed_cholesky(columns, dim, shift, dtype, block_size)
        if panels is None:
            continue
        scores = (1.0 - shift * _packed_inverse_diagonal(panels, dim, block_size)).clamp_(min=0.0)
        if refine_top_k is not None and dtype != torch.float64 and 0 < refine_top_k < dim:
            trace = _mean_abs_diagonal(columns, dim, block_size) * dim
            margin = 8.0 * (1.0 + trace / shift) * torch.finfo(dtype).eps
            cut = float(scores.topk(refine_top_k).values[-1])
            distance = (scores - cut).abs()
            near = torch.nonzero(distance <= margin).flatten()
            most = max_refined(dim)
            if near.numel() > most:
                near = near[distance[near].argsort()[:most]]
            exact = _refined_inverse_entries(columns, dim, shift, panels, near, block_size)
            scores[near] = (1.0 - shift * exact).clamp_(min=0.0)
        return scores
    raise torch.linalg.LinAlgError("matrix is not positive definite even with jitter; is the calibration data empty?")


#: Most channels `ridge_leverage_scores_packed` re-scores in float64 around the cut (each costs two solves with the
#: factor and one product with C per refinement step, and four float64 columns of memory).
MAX_REFINED = 1024


def max_refined(dim: int) -> int:
    """How many channels near the cut are re-scored at most: 1/64 of them (at least 64, at most MAX_REFINED)."""
    return min(dim, MAX_REFINED, max(64, dim // 64))


def _packed_solve(panels: list[torch.Tensor], rhs: torch.Tensor, block_size: int) -> torch.Tensor:
    """x with L Lᵀ x = rhs, L given as its column panels (forward then backward substitution, in L's dtype)."""
    dim = rhs.shape[0]
    x = rhs.to(panels[0].dtype).clone()
    precision, columns = flops.precision_of(x.dtype), x.shape[1] if x.dim() > 1 else 1
    for index, panel in enumerate(panels):
        start, width = index * block_size, panel.shape[1]
        # This panel's triangle and the rows below it, forward here and backward below: twice each.
        flops.record(2 * flops.triangular_solve(width, columns), precision, "factorisation")
        flops.record(2 * flops.product(dim - start - width, width, columns), precision)
        x[start : start + width] = torch.linalg.solve_triangular(panel[:width], x[start : start + width], upper=False)
        if start + width < dim:
            x[start + width :].addmm_(panel[width:], x[start : start + width], alpha=-1.0)
    for index in reversed(range(len(panels))):
        panel = panels[index]
        start, width = index * block_size, panel.shape[1]
        if start + width < dim:
            x[start : start + width].addmm_(panel[width:].T, x[start + width :], alpha=-1.0)
        x[start : start + width] = torch.linalg.solve_triangular(panel[:width].T, x[start : start + width], upper=True)
    return x


def _shifted_product(
    columns: Callable[[int, int], torch.Tensor], dim: int, shift: float, x: torch.Tensor, block_size: int
) -> torch.Tensor:
    """(C + shift·I) x in float64 from the lower column panels of the symmetric C."""
    result = shift * x
    flops.record(flops.product(dim, dim, x.shape[1] if x.dim() > 1 else 1), "float64")  # both halves of C, by panels
    for start in range(0, dim, block_size):
        stop = min(dim, start + block_size)
        panel = columns(start, stop).double()  # C[start:, start:stop]
        result[start:] += panel @ x[start:stop]
        if stop < dim:
            result[start:stop] += panel[stop - start :].T @ x[stop:]
    return result


def _refined_inverse_entries(
    columns: Callable[[int, int], torch.Tensor],
    dim: int,
    shift: float,
    panels: list[torch.Tensor],
    channels: torch.Tensor,
    block_size: int,
    steps: int = 4,
) -> torch.Tensor:
    """[(C + shift·I)⁻¹]_ii for `channels`, float64, by iterative refinement on a low-precision factor.

    Each step solves for the float64 residual with the factor; the error shrinks by about cond · eps(factor) per
    step (< 1e-3 for the λ FlattenGPT uses), so four steps reach float64 rounding.
    """
    device = panels[0].device
    channels = channels.to(device)
    columns_index = torch.arange(channels.numel(), device=device)
    unit = torch.zeros(dim, channels.numel(), dtype=torch.float64, device=device)
    unit[channels, columns_index] = 1.0
    x = _packed_solve(panels, unit, block_size).double()
    for _ in range(steps):
        residual = unit - _shifted_product(columns, dim, shift, x, block_size)
        x += _packed_solve(panels, residual, block_size).double()
    return x[channels, columns_index]


def _mean_abs_diagonal(columns: Callable[[int, int], torch.Tensor], dim: int, block_size: int) -> float:
    total = 0.0
    for start in range(0, dim, block_size):
        stop = min(dim, start + block_size)
        total += float(columns(start, stop)[: stop - start].diagonal().double().abs().sum())
    return max(total / dim, 1e-30)


def _packed_cholesky(
    columns: Callable[[int, int], torch.Tensor], dim: int, shift: float, dtype: torch.dtype, block_size: int
) -> list[torch.Tensor] | None:
    """Lower Cholesky factor of C + shift·I as panels L[j·b:, j·b:(j+1)·b], or None if C + shift·I is not PD."""
    panels: list[torch.Tensor] = []
    for start in range(0, dim, block_size):
        stop = min(dim, start + block_size)
        width = stop - start
        panel = columns(start, stop).to(dtype)
        panel[:width].diagonal().add_(shift)
        precision = flops.precision_of(dtype)
        # Left-looking: every earlier panel's rows from here on times its rows of this panel, then the panel's own
        # triangle factorised and the rows below it solved against it.
        flops.record(sum(flops.product(dim - start, p.shape[1], width) for p in panels), precision)
        flops.record(flops.cholesky(width) + flops.triangular_solve(width, dim - stop), precision, "factorisation")
        for index, previous in enumerate(panels):
            offset = start - index * block_size  # row of `previous` that is global row `start`
            panel.addmm_(previous[offset:], previous[offset : offset + width].T, alpha=-1.0)
        diagonal, info = torch.linalg.cholesky_ex(panel[:width])
        flops.record_host_reads(1)
        if int(info) != 0:
            return None
        panel[:width] = diagonal
        if stop < dim:
            panel[width:] = torch.linalg.solve_triangular(diagonal.T, panel[width:], upper=True, left=False)
        panels.append(panel)
    return panels


def _packed_inverse_diagonal(panels: list[torch.Tensor], dim: int, block_size: int) -> torch.Tensor:
    """diag((L Lᵀ)⁻¹) in float64: entry i is the squared norm of column i of L⁻¹ (zero above row i)."""
    result = torch.empty(dim, dtype=torch.float64, device=panels[0].device)
    for first, head in enumerate(panels):
        start, width = first * block_size, head.shape[1]
        rhs = torch.zeros(dim - start, width, dtype=head.dtype, device=head.device)
        rhs[:width].diagonal().fill_(1.0)
        for index in range(first, len(panels)):
            panel = panels[index]
            row, size = (index - first) * block_size, panel.shape[1]
            flops.record(flops.triangular_solve(size, width), flops.precision_of(head.dtype), "factorisation")
            flops.record(flops.product(rhs.shape[0] - row - size, size, width), flops.precision_of(head.dtype))
            rhs[row : row + size] = torch.linalg.solve_triangular(panel[:size], rhs[row : row + size], upper=False)
            if row + size < rhs.shape[0]:
                rhs[row + size :].addmm_(panel[size:], rhs[row : row + size], alpha=-1.0)
        result[start : start + width] = rhs.square().sum(dim=0, dtype=torch.float64)
    return result


def ridge_factor(kept_block: torch.Tensor, lam: float) -> torch.Tensor:
    """The Cholesky factor of C[K, K] + λI (jitter added if rounding made it indefinite; the block is restored).

    A caller that holds nothing else of C[K, K] can drop the block once it has the factor: the solve that follows
    (`nystrom_from_factor`) makes a column-major copy of the factor, so holding the block too costs a third k × k
    float64 matrix (6.1 GiB at LLaMA-2-70B, measured on an H100)."""
    return _shifted_cholesky(kept_block, lam)[0]


def nystrom_from_factor(factor: torch.Tensor, cross: torch.Tensor, kept_rows: torch.Tensor) -> torch.Tensor:
    """W_D[K] + (C[K,K] + λI)⁻¹ C[K,R] W_D[R] given the factor of C[K,K] + λI (`ridge_factor`)."""
    flops.record(flops.cholesky_solve(factor.shape[0], cross.shape[1]), "float64", "factorisation")
    return kept_rows.double() + torch.cholesky_solve(cross.double(), factor)


def kept_blocks(
    block: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dim: int,
    down_rows: torch.Tensor,
    keep: torch.Tensor,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C[K, K] and C[K, R] W_D[R] in float64, reading C through `block(rows, cols)` `chunk` dropped channels at a
    time: no float64 copy of C or of W_D is made, only the k × k block the solve needs."""
    keep = torch.as_tensor(keep, dtype=torch.long, device=down_rows.device)
    dropped_mask = torch.ones(dim, dtype=torch.bool, device=down_rows.device)
    dropped_mask[keep] = False
    dropped = torch.nonzero(dropped_mask).flatten()
    cross = torch.zeros(keep.numel(), down_rows.shape[1], dtype=torch.float64, device=down_rows.device)
    flops.record(flops.product(keep.numel(), dropped.numel(), down_rows.shape[1]), "float64")
    for part in dropped.split(chunk):
        cross.addmm_(block(keep, part).to(cross.device), down_rows[part].double())
    return kept_block(block, keep, down_rows.device, chunk), cross


def kept_block(
    block: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    keep: torch.Tensor,
    device: torch.device,
    chunk: int = 1024,
) -> torch.Tensor:
    """C[K, K] in float64 on `device`, read through `block(rows, cols)` `chunk` kept channels at a time: all a refit
    towards another target needs of C (`ridge_refit_to_target`), where `kept_blocks`' C[K, R] W_D[R] is not used."""
    kept = torch.empty(keep.numel(), keep.numel(), dtype=torch.float64, device=device)
    for start in range(0, keep.numel(), chunk):
        kept[:, start : start + chunk] = block(keep, keep[start : start + chunk])
    return kept
