"""Greedy backward elimination of channel blocks under a ridge refit: which blocks (KV groups of a merged attention)
to keep so that the kept channels, refitted, best reproduce a target (FlattenGPT's ``head_selection="reconstruction"``).

The refit on kept channels K solves A W* = B with A = C_KK + λI and B = S_K + λ W_K (`ridge.ridge_refit_to_target`).
With P = A⁻¹, dropping block J leaves the refit W' = W*_K' − P_K'J P_JJ⁻¹ W*_J on K' = K without J, and its inverse
P' = P_K'K' − P_K'J P_JJ⁻¹ P_JK' (the principal-submatrix identity behind Optimal Brain Surgeon). So one factorisation
of A serves the whole search: each step scores every removal from P, W*, B, D = W* − W_K and PD
(`KeptRefit.removal_errors`), drops the cheapest and downdates P and W* in O(k²·J) (`KeptRefit.drop_`), instead of
factorising the kept block again, O(k³), as each step did before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..utils import flops
from .ridge import _shifted_cholesky

#: Kernels `KeptRefit.removal_errors` launches for each chunk of blocks it scores at once (counted from its code).
REMOVAL_LAUNCHES = 30
#: Kernels `KeptRefit.drop_` launches for one downdate (counted from its code).
DOWNDATE_LAUNCHES = 16
#: Float64 elements of one chunk's largest temporary (its channels × the hidden size): blocks of one size are scored
#: together up to this many, so that the launches and host reads are per chunk, not per block, while the chunk's few
#: temporaries stay small beside the k × k inverse every step holds.
REMOVAL_CHUNK_ELEMENTS = 1 << 23
#: Devices on which `_inner` is one batched product (elsewhere an elementwise product and a sum).
INNER_AS_PRODUCT = ("cpu",)


def removal_chunks(sizes: Sequence[int], hidden: int) -> list[tuple[int, int, int]]:
    """(first channel, blocks, block size) of each chunk `KeptRefit.removal_errors` scores at once: runs of
    consecutive blocks of one size, cut so that no chunk has more than `REMOVAL_CHUNK_ELEMENTS` // `hidden` channels
    (at least one block). Channels count in the order the blocks are given."""
    chunks, start, index = [], 0, 0
    while index < len(sizes):
        size = int(sizes[index])
        most = max(1, REMOVAL_CHUNK_ELEMENTS // max(1, hidden * size))
        count = 1
        while index + count < len(sizes) and sizes[index + count] == size and count < most:
            count += 1
        chunks.append((start, count, size))
        start += count * size
        index += count
    return chunks


def _block_diagonal(matrix: torch.Tensor, start: int, count: int, size: int) -> torch.Tensor:
    """The `count` diagonal blocks of `size` × `size` from (start, start) on, as a (count, size, size) view."""
    span = matrix[start : start + count * size, start : start + count * size]
    return span.unflatten(0, (count, size)).unflatten(2, (count, size)).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def _spd_factors(blocks: torch.Tensor) -> torch.Tensor:
    """Cholesky factors of a batch of symmetric positive definite blocks: one batched factorisation, and for a block
    that rounding made indefinite, `_shifted_cholesky`'s growing jitter alone (as one factorisation each would)."""
    factors, info = torch.linalg.cholesky_ex(blocks)
    flops.record(blocks.shape[0] * flops.cholesky(blocks.shape[-1]), "float64", "factorisation")
    flops.record_host_reads(1)
    for index in info.nonzero().flatten().tolist():
        factors[index] = _shifted_cholesky(blocks[index].clone(), 0.0)[0]
    return factors


def _inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """⟨x_b, y_b⟩ for each leading index b.

    On the CPU one batched product, without the elementwise product's tensor. Elsewhere the product and a sum: as a
    batched product each of these is a 1 × 1 output with an inner dimension of a block's channels × the hidden size
    (524,288 at LLaMA-2-7B), which a GPU runs on one block of threads per entry; the H100 profile of 2026-11-27 put
    the search's batched products, six of its eleven per chunk these, at about 4% of the FP64 peak. The product's
    tensor is one chunk's size, as the chunk's other temporaries (`REMOVAL_CHUNK_ELEMENTS`).
    """
    if x.device.type in INNER_AS_PRODUCT:
        return torch.einsum("bij,bij->b", x, y)
    return (x * y).sum(dim=(1, 2))


@dataclass
class KeptRefit:
    """The ridge refit on the kept channels K, rows in the order of their blocks (`sizes`), float64: P = (C_KK + λI)⁻¹,
    W* = P B, B = S_K + λ W_K, W_K (`rows`), D = W* − W_K and PD."""

    inverse: torch.Tensor
    refit: torch.Tensor
    rhs: torch.Tensor
    rows: torch.Tensor
    delta: torch.Tensor
    inverse_delta: torch.Tensor
    sizes: list[int]

    @classmethod
    def fit(
        cls,
        second_moment: torch.Tensor,
        cross: torch.Tensor,
        rows: torch.Tensor,
        blocks: Sequence[torch.Tensor],
        lam: float,
    ) -> KeptRefit:
        """The refit on every channel of `blocks` (disjoint index sets of C's channels): one Cholesky factor of
        C_KK + λI (with `_shifted_cholesky`'s jitter if rounding needs it) and the inverse it gives."""
        c = second_moment.double()
        keep = torch.cat([torch.as_tensor(b, dtype=torch.long, device=c.device) for b in blocks])
        w0 = rows.double()[keep]
        rhs = cross.double()[keep] + lam * w0
        factor, _ = _shifted_cholesky(c[keep[:, None], keep], lam)
        inverse = torch.cholesky_inverse(factor)
        del factor
        refit = inverse @ rhs
        delta = refit - w0
        k, hidden = keep.numel(), w0.shape[1]
        flops.record(flops.cholesky_inverse(k), "float64", "factorisation")
        flops.record(2 * flops.product(k, k, hidden), "float64")
        return cls(inverse, refit, rhs, w0, delta, inverse @ delta, [len(b) for b in blocks])

    def removal_errors(self, target_energy: float, lam: float) -> torch.Tensor:
        """For each block, the `ridge.ridge_target_error` of keeping every other block (float64, on the CPU).

        The data error after dropping J is E‖t‖² + λ‖W_K'‖² − tr(B_K'ᵀ W') − λ‖W' − W_K'‖², and every term of it
        reduces to J × J and J × hidden products of P, W*, PD, D and B. The removals are scored a chunk of equal
        blocks at a time (`removal_chunks`), as batched products over views, with the scalars kept on the device
        and read back once: at LLaMA-2-7B (64 KV groups of 128 channels a merged pair) about 30 kernels and one read
        per 16 groups, where one group at a time took 34 kernels and 7 reads each.
        """
        inverse, refit, rhs, w0, delta = self.inverse, self.refit, self.rhs, self.rows, self.delta
        k, hidden = w0.shape
        # Everything that does not depend on the block: E‖t‖² + λ‖W_K‖² − tr(Bᵀ W*) − λ‖D‖², on the device.
        base = target_energy + lam * w0.square().sum() - _inner(rhs[None], refit[None])[0] - lam * delta.square().sum()
        errors = torch.empty(len(self.sizes), dtype=torch.float64, device=inverse.device)
        first = 0
        for start, count, size in removal_chunks(self.sizes, hidden):
            flops.record_launches(REMOVAL_LAUNCHES)
            # Per block: P_JJ B_J, P_JJ D_J, Pᵀ_J P_J − P_JJ², its product with Z; the solve for Z.
            products = 3 * flops.product(size, size, hidden) + flops.product(size, k, size)
            products += flops.product(size, size, size)
            flops.record(count * products, "float64")
            flops.record(count * flops.cholesky_solve(size, hidden), "float64", "factorisation")
            span = slice(start, start + count * size)
            p_jj = _block_diagonal(inverse, start, count, size)
            refit_j, b_j, delta_j, w0_j, inverse_delta_j = (
                t[span].unflatten(0, (count, size)) for t in (refit, rhs, delta, w0, self.inverse_delta)
            )
            z = torch.cholesky_solve(refit_j, _spd_factors(p_jj.contiguous()))  # P_JJ⁻¹ W*_J
            # tr(B_K'ᵀ W') = tr(Bᵀ W*) − tr(B_Jᵀ W*_J) − ⟨W*_J − P_JJ B_J, Z⟩  (P_K'Jᵀ B_K' = W*_J − P_JJ B_J)
            fit_j = _inner(b_j, refit_j) + _inner(refit_j - p_jj @ b_j, z)
            # ‖W' − W_K'‖² = ‖D‖² − ‖D_J‖² − 2⟨(PD)_J − P_JJ D_J, Z⟩ + tr(Zᵀ (P_K'Jᵀ P_K'J) Z)
            rows_j = inverse[span].unflatten(0, (count, size))  # P_J's rows: P symmetric, so P_Jᵀ P_J = rows rowsᵀ
            gram = rows_j @ rows_j.transpose(1, 2) - p_jj @ p_jj
            moved_j = -_inner(delta_j, delta_j) - 2 * _inner(inverse_delta_j - p_jj @ delta_j, z) + _inner(z, gram @ z)
            errors[first : first + count] = base - lam * _inner(w0_j, w0_j) + fit_j - lam * moved_j
            first += count
        flops.record_host_reads(1)
        return errors.cpu()

    def drop_(self, index: int) -> None:
        """Drops block `index` from the refit, downdated in place: with L the Cholesky factor of P_JJ,
        X = L⁻¹ P_JK' and Y = L⁻¹ W*_J, P' = P_K'K' − Xᵀ X and W' = W*_K' − Xᵀ Y (exact in exact arithmetic: the
        identities in the module docstring), then D' and P'D' anew: O(k²·(J + hidden)) where a new factorisation
        and its inverse cost O(k³). One field is replaced at a time, so beside the state it holds at most the new
        inverse while the old one is still there, as a factorisation held the factor and the inverse."""
        start = sum(self.sizes[:index])
        size = self.sizes[index]
        k, hidden = self.rows.shape
        device = self.inverse.device
        rest = torch.cat([torch.arange(start, device=device), torch.arange(start + size, k, device=device)])
        factor = _spd_factors(self.inverse[start : start + size, start : start + size][None].contiguous())[0]
        x = torch.linalg.solve_triangular(factor, self.inverse[start : start + size, rest], upper=False)
        y = torch.linalg.solve_triangular(factor, self.refit[start : start + size], upper=False)
        self.inverse = self.inverse[rest[:, None], rest].addmm_(x.T, x, alpha=-1)
        self.refit = self.refit[rest].addmm_(x.T, y, alpha=-1)
        self.rhs, self.rows = self.rhs[rest], self.rows[rest]
        self.delta = self.refit - self.rows
        self.inverse_delta = self.inverse @ self.delta
        del self.sizes[index]
        r = k - size
        flops.record_launches(DOWNDATE_LAUNCHES)
        solves = flops.triangular_solve(size, r) + flops.triangular_solve(size, hidden)
        flops.record(solves, "float64", "factorisation")
        products = flops.product(r, size, r) + flops.product(r, size, hidden) + flops.product(r, r, hidden)
        flops.record(products, "float64")


def greedy_block_elimination(
    second_moment: torch.Tensor,
    cross: torch.Tensor,
    target_energy: float,
    rows: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    num_keep: int,
    lam: float,
) -> list[int]:
    """Indices (into `blocks`, ascending) of the `num_keep` blocks a greedy backward elimination keeps: repeatedly drop
    the block whose removal leaves the least `ridge.ridge_target_error`. One factorisation for the whole search;
    each step scores every removal and downdates the refit (`KeptRefit`)."""
    if not 0 < num_keep <= len(blocks):
        raise ValueError(f"num_keep must be between 1 and {len(blocks)} blocks, got {num_keep}.")
    alive = list(range(len(blocks)))
    refit = KeptRefit.fit(second_moment, cross, rows, blocks, lam)
    while len(alive) > num_keep:
        drop = int(torch.argmin(refit.removal_errors(target_energy, lam)))
        del alive[drop]
        refit.drop_(drop)
    return alive
