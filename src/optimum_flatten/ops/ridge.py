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

import torch


def default_ridge_lambda(second_moment: torch.Tensor, ratio: float) -> float:
    """λ = ratio × mean eigenvalue of C (trace / dim); scale-free, so one ratio fits every layer."""
    c = second_moment.double()
    return float(ratio) * float(torch.trace(c)) / c.shape[0]


def _shifted_cholesky(matrix: torch.Tensor, shift: float) -> tuple[torch.Tensor, float]:
    """Cholesky factor of `matrix + shift·I`, and the shift actually used.

    If rounding made the matrix indefinite, a growing jitter (relative to its mean diagonal) is added to the shift;
    callers that need the exact shift (the leverage formula) read it back. The shift is added to the diagonal of
    `matrix` in place and the saved diagonal put back afterwards (bit for bit, also on error), so the only n × n
    allocation is the factor: the statistics are the largest tensors FlattenGPT holds.
    """
    diagonal = matrix.diagonal()
    saved = diagonal.clone()
    scale = float(saved.abs().mean().clamp_min(1e-30))
    try:
        for jitter in [0.0] + [scale * 10.0**exponent for exponent in range(-12, 0)]:
            diagonal.copy_(saved).add_(shift + jitter)
            factor, info = torch.linalg.cholesky_ex(matrix)
            if int(info) == 0:
                return factor, shift + jitter
            del factor
    finally:
        diagonal.copy_(saved)
    raise torch.linalg.LinAlgError("matrix is not positive definite even with jitter; is the calibration data empty?")


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
    return float(full - 2 * (delta * cross).sum() + (delta * (c_kk @ delta)).sum())
