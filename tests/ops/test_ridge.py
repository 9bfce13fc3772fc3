import torch

from common import assert_close
from optimum_flatten.ops import (
    default_ridge_lambda,
    nystrom_down_correction,
    ridge_leverage_scores,
    ridge_reconstruction_error,
)


def _activations(n_tokens=200, dim=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    return torch.randn(n_tokens, dim, generator=g, dtype=torch.float64) @ mixing


def test_leverage_matches_eigendecomposition_reference():
    a = _activations()
    c = a.T @ a / a.shape[0]
    lam = default_ridge_lambda(c, 0.5)
    assert abs(lam - 0.5 * torch.trace(c).item() / c.shape[0]) < 1e-12
    eigenvalues, vectors = torch.linalg.eigh(c)
    reference = torch.diagonal(vectors @ torch.diag(eigenvalues / (eigenvalues + lam)) @ vectors.T)
    assert_close(ridge_leverage_scores(c, lam), reference)
    for block_size in (1, 3, 7):  # the diagonal of the inverse is solved in column panels
        assert_close(ridge_leverage_scores(c, lam, block_size=block_size), reference)


def test_nystrom_correction_equals_ridge_least_squares():
    a = _activations(seed=1)
    n_tokens, dim = a.shape
    c = a.T @ a / n_tokens
    g = torch.Generator().manual_seed(2)
    w_down = torch.randn(dim, 5, generator=g, dtype=torch.float64)  # channels x hidden
    keep = torch.tensor([0, 2, 3, 7, 9])
    dropped = torch.tensor([1, 4, 5, 6, 8])
    lam = 0.3
    # Reference: W' = W_K + Δ, Δ = argmin (1/N)||A_K Δ - A_R W_R||² + λ||Δ||², as an augmented lstsq problem.
    lhs = torch.cat([a[:, keep], (n_tokens * lam) ** 0.5 * torch.eye(len(keep), dtype=torch.float64)])
    rhs = torch.cat([a[:, dropped] @ w_down[dropped], torch.zeros(len(keep), 5, dtype=torch.float64)])
    delta = torch.linalg.lstsq(lhs, rhs).solution
    assert_close(nystrom_down_correction(c, w_down, keep, lam), w_down[keep] + delta, torch.float64)


def test_nystrom_matches_theorem_formula_with_selection_matrices():
    a = _activations(seed=3)
    c = a.T @ a / a.shape[0]
    dim = c.shape[0]
    w = torch.randn(dim, 4, dtype=torch.float64)
    keep = torch.tensor([1, 3, 4, 8])
    lam = 1.7
    s_k = torch.eye(dim, dtype=torch.float64)[:, keep]
    inner = s_k.T @ c @ s_k + lam * torch.eye(len(keep), dtype=torch.float64)
    formula = s_k.T @ w + torch.linalg.solve(inner, s_k.T @ c @ (torch.eye(dim, dtype=torch.float64) - s_k @ s_k.T) @ w)
    assert_close(nystrom_down_correction(c, w, keep, lam), formula, torch.float64)


def test_keeping_every_channel_is_identity():
    a = _activations(seed=4)
    c = a.T @ a / a.shape[0]
    w = torch.randn(c.shape[0], 3, dtype=torch.float64)
    keep = torch.arange(c.shape[0])
    assert torch.equal(nystrom_down_correction(c, w, keep, 1.0), w)


def test_correction_reduces_reconstruction_error():
    a = _activations(seed=5)
    c = a.T @ a / a.shape[0]
    w = torch.randn(c.shape[0], 3, dtype=torch.float64)
    keep = torch.tensor([0, 1, 2, 3, 4, 5])
    corrected = nystrom_down_correction(c, w, keep, 1e-3 * torch.trace(c).item())
    target = a @ w
    plain_error = (a[:, keep] @ w[keep] - target).norm()
    corrected_error = (a[:, keep] @ corrected - target).norm()
    assert corrected_error < 0.9 * plain_error


def test_singular_second_moment_is_handled_with_jitter():
    a = _activations(n_tokens=3, dim=8, seed=6)  # rank 3
    c = a.T @ a / 3
    scores = ridge_leverage_scores(c, 0.0)
    assert torch.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
    # The jitter acts as the ridge: the scores are those of the smallest shift that factorised.
    assert abs(float(scores.sum()) - 3.0) < 1e-2


def test_reconstruction_error_matches_direct_evaluation():
    a = _activations(n_tokens=300, dim=9, seed=7)
    c = a.T @ a / a.shape[0]
    w = torch.randn(9, 4, dtype=torch.float64)
    keep = torch.tensor([0, 4, 5, 8])
    lam = 0.2
    corrected = nystrom_down_correction(c, w, keep, lam)
    direct = ((a @ w - a[:, keep] @ corrected) ** 2).sum() / a.shape[0]
    assert abs(ridge_reconstruction_error(c, w, keep, lam) - float(direct)) < 1e-9 * float(direct)
    assert ridge_reconstruction_error(c, w, torch.arange(9), lam) == 0.0


def test_solves_leave_the_second_moment_bit_for_bit_unchanged():
    # The shift is added to the diagonal in place (no second n x n matrix) and must be put back exactly.
    a = _activations(seed=9)
    c = a.T @ a / a.shape[0]
    before = c.clone()
    lam = default_ridge_lambda(c, 0.7)
    ridge_leverage_scores(c, lam)
    nystrom_down_correction(c, torch.randn(10, 3, dtype=torch.float64), torch.tensor([0, 2, 5]), lam)
    ridge_reconstruction_error(c, torch.randn(10, 3, dtype=torch.float64), torch.tensor([1, 4]), lam)
    assert torch.equal(c, before)
