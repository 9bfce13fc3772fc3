"""Greedy elimination of channel blocks under a ridge refit (`ops.block_elimination`): every removal's error from one
factorisation, the downdate after a drop, and the search, each against a refit from scratch."""

import pytest
import torch

from optimum_flatten.ops import block_elimination
from optimum_flatten.ops.block_elimination import (
    KeptRefit,
    _spd_factors,
    greedy_block_elimination,
    removal_chunks,
)
from optimum_flatten.ops.ridge import _shifted_cholesky, default_ridge_lambda, ridge_target_error


def _problem(sizes, hidden=4, tokens=300, seed=3):
    """(C, S, E‖t‖², W, blocks, λ) of random correlated inputs and a target that is not a function of them."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    a = torch.randn(tokens, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    t = a[:, :hidden] * 0.5 + torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    c, s, energy = a.T @ a / tokens, a.T @ t / tokens, float(t.square().sum()) / tokens
    rows = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    bounds = torch.tensor((0, *sizes)).cumsum(0)
    blocks = [torch.arange(int(bounds[i]), int(bounds[i + 1])) for i in range(len(sizes))]
    return c, s, energy, rows, blocks, default_ridge_lambda(c, 0.5)


@pytest.mark.parametrize(
    ("sizes", "chunk_elements"),
    [((3, 3, 3, 3, 3), 1 << 23), ((1, 4, 2, 5), 1 << 23), ((3, 3, 3, 3, 3, 2, 2), 24), ((2, 2, 3, 2), 1)],
)
def test_block_removal_errors_match_a_refit_of_each_reduced_set(sizes, chunk_elements, monkeypatch):
    """One factorisation scores every removal: each error equals `ridge_target_error` on the set without that block
    (a separate factorisation per candidate), for a target that is not a function of the inputs."""
    c, s, energy, rows, blocks, lam = _problem(sizes)
    monkeypatch.setattr(block_elimination, "REMOVAL_CHUNK_ELEMENTS", chunk_elements)  # whole runs, or chunks of 2 or 1
    errors = KeptRefit.fit(c, s, rows, blocks, lam).removal_errors(energy, lam)
    for j in range(len(blocks)):
        rest = torch.cat([b for i, b in enumerate(blocks) if i != j])
        expected = ridge_target_error(c, s, energy, rows, rest, lam)
        assert abs(float(errors[j]) - expected) <= 1e-10 * abs(expected)


def test_the_accelerators_inner_products_score_as_the_cpus(monkeypatch):
    """On an accelerator the chunk's inner products are an elementwise product and a sum instead of one batched
    product (`_inner`); the same removal errors, here forced on the CPU, against a refit of each reduced set."""
    c, s, energy, rows, blocks, lam = _problem((3, 3, 3, 3, 2))
    expected = KeptRefit.fit(c, s, rows, blocks, lam).removal_errors(energy, lam)
    monkeypatch.setattr(block_elimination, "INNER_AS_PRODUCT", ())
    errors = KeptRefit.fit(c, s, rows, blocks, lam).removal_errors(energy, lam)
    torch.testing.assert_close(errors, expected, rtol=1e-12, atol=0)
    for j in range(len(blocks)):
        rest = torch.cat([b for i, b in enumerate(blocks) if i != j])
        reference = ridge_target_error(c, s, energy, rows, rest, lam)
        assert abs(float(errors[j]) - reference) <= 1e-10 * abs(reference)


def test_removal_chunks_are_runs_of_equal_blocks_cut_at_the_element_budget(monkeypatch):
    monkeypatch.setattr(block_elimination, "REMOVAL_CHUNK_ELEMENTS", 40)
    # hidden 4: at most 10 channels a chunk, so 5 blocks of 2, 3 of 3, and a block larger than that alone.
    assert removal_chunks([2] * 7 + [3] * 4 + [12, 2], 4) == [
        (0, 5, 2),
        (10, 2, 2),
        (14, 3, 3),
        (23, 1, 3),
        (26, 1, 12),
        (38, 1, 2),
    ]
    assert removal_chunks([], 4) == []


def test_a_block_that_rounding_made_indefinite_gets_the_jitter_of_its_own_factorisation():
    g = torch.Generator().manual_seed(11)
    good = torch.randn(5, 5, generator=g, dtype=torch.float64)
    good = good @ good.T + torch.eye(5, dtype=torch.float64)
    low = torch.randn(5, 2, generator=g, dtype=torch.float64)
    singular = low @ low.T  # rank 2: no plain Cholesky factor
    singular[0, 0] -= 1e-9
    factors = _spd_factors(torch.stack([good, singular, good]))
    assert torch.equal(factors[0], torch.linalg.cholesky(good)) and torch.equal(factors[2], factors[0])
    assert torch.equal(factors[1], _shifted_cholesky(singular.clone(), 0.0)[0])


@pytest.mark.parametrize("sizes", [(3, 3, 3, 3, 3, 3), (2, 4, 2, 3, 1)])
def test_the_downdate_after_a_drop_equals_a_refit_of_the_rest(sizes):
    c, s, _, rows, blocks, lam = _problem(sizes)
    refit = KeptRefit.fit(c, s, rows, blocks, lam)
    for drop in (1, 0, 2):  # three drops in a row, so the downdates compound
        refit.drop_(drop)
        blocks = blocks[:drop] + blocks[drop + 1 :]
        fresh = KeptRefit.fit(c, s, rows, blocks, lam)
        assert refit.sizes == fresh.sizes
        for name in ("inverse", "refit", "rhs", "rows", "delta", "inverse_delta"):
            expected, scale = getattr(fresh, name), float(getattr(fresh, name).abs().max())
            assert torch.allclose(getattr(refit, name), expected, rtol=0, atol=1e-10 * scale), name


def test_the_greedy_search_keeps_what_a_refit_of_every_candidate_at_every_step_keeps():
    sizes = (3, 2, 3, 3, 2, 3, 3, 1)
    c, s, energy, rows, blocks, lam = _problem(sizes, seed=5)
    alive = list(range(len(blocks)))
    while len(alive) > 3:  # the naive search: one refit from scratch per candidate and step
        errors = [
            ridge_target_error(c, s, energy, rows, torch.cat([blocks[i] for i in alive if i != j]), lam) for j in alive
        ]
        del alive[min(range(len(alive)), key=errors.__getitem__)]
    assert greedy_block_elimination(c, s, energy, rows, blocks, 3, lam) == alive
    assert greedy_block_elimination(c, s, energy, rows, blocks, len(blocks), lam) == list(range(len(blocks)))
    with pytest.raises(ValueError, match="num_keep must be between 1 and 8 blocks, got 0"):
        greedy_block_elimination(c, s, energy, rows, blocks, 0, lam)


@pytest.mark.gpu
def test_the_search_on_cuda_keeps_the_cpus_groups_and_scores():
    sizes = (4, 4, 4, 4, 4, 4, 4, 4)
    c, s, energy, rows, blocks, lam = _problem(sizes, seed=7)
    on_cuda = [t.cuda() for t in (c, s, rows)]
    kept = greedy_block_elimination(on_cuda[0], on_cuda[1], energy, on_cuda[2], [b.cuda() for b in blocks], 3, lam)
    assert kept == greedy_block_elimination(c, s, energy, rows, blocks, 3, lam)
    errors = KeptRefit.fit(*on_cuda[:2], on_cuda[2], [b.cuda() for b in blocks], lam).removal_errors(energy, lam)
    assert errors.device.type == "cpu"
    expected = KeptRefit.fit(c, s, rows, blocks, lam).removal_errors(energy, lam)
    torch.testing.assert_close(errors, expected, rtol=1e-10, atol=0)
