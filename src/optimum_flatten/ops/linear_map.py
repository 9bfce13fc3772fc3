"""A (hidden x hidden) linear map fitted on calibration tokens, and its exact fold into a linear layer.

ReplaceMe (Shopkhoev et al., NeurIPS 2025, arXiv 2505.02819, Sec. 3) replaces the blocks i+1..i+n by one matrix T
applied to the MLP output M_i of block i, chosen so that ``M_i T + Y_i`` approximates the output L_{i+n} of the last
replaced block (Y_i: the residual stream of block i before its MLP is added). Two objectives:

- least squares (their Eq. for the L2 distance): ``T* = (MᵀM)⁻¹ Mᵀ (L − Y)``, in closed form;
- cosine distance ``1 − cos(M T + Y, L)`` per token, minimised numerically with Adam from T = I.

Not in the paper, ``"lstsq_down"`` fits the down projection of block i itself on what it reads, the MLP's
intermediate activation A (rows ``a``): ``W'* = argmin Σ‖a W'ᵀ (+ b') − (l − y)‖²``. ReplaceMe's map is the special
case ``W' = Tᵀ W_down`` (M = A W_downᵀ), so on the calibration tokens this fit is never worse than T's; it has
intermediate × hidden parameters instead of hidden × hidden, and it *is* the new down projection (no fold).

Rows are tokens, so a token's new MLP output is the row vector ``m T``; in a linear layer's (out, in) convention
``y = W a + b`` this is ``Tᵀ (W a + b)``: the fold is ``W' = Tᵀ W``, ``b' = Tᵀ b``, exact up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..utils import flops
from .ridge import cholesky_shifted_in_place

#: Token rows converted to float64 at a time by `LinearMapStatistics.update`: bounds the float64 copies of a batch
#: (at LLaMA-2-7B's MLP width a whole 8 x 2048 batch would be 1.4 GB) without changing the sums' order of magnitude.
UPDATE_CHUNK_ROWS = 4096


class LinearMapStatistics:
    """Running float64 sums ``MᵀM`` and ``MᵀR`` over real tokens; no token matrix is kept beyond one batch.

    float64, because the normal equations square the condition number of M: in float32 a hidden state whose
    channels differ by 10⁴ in scale (massive activations) would lose its small directions entirely.

    Args:
        dim: Width of the inputs M.
        device: Where the sums live.
        with_gain: Also accumulate what `solve_least_squares_with_gain` needs.
        out_dim: Width of the targets R (default `dim`: ReplaceMe's square map).
        intercept: Append a constant 1 to every input row, so the solution's last row is a bias.
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str = "cpu",
        with_gain: bool = False,
        out_dim: int | None = None,
        intercept: bool = False,
    ) -> None:
        if with_gain and (intercept or (out_dim is not None and out_dim != dim)):
            raise ValueError("a stream gain is fitted with ReplaceMe's square map only (no intercept, out_dim=dim).")
        self.intercept = intercept
        width = dim + int(intercept)
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.cross = torch.zeros(width, dim if out_dim is None else out_dim, dtype=torch.float64, device=device)
        self.count = 0
        #: ‖R‖² over the same tokens: the constant of the squared error, so that a held-out error is a real one.
        self.target_norm = 0.0
        #: With a stream gain (`solve_least_squares_with_gain`): MᵀY, ⟨Y, R⟩ and ⟨Y, Y⟩ over the same tokens.
        self.with_gain = with_gain
        self.stream_cross = torch.zeros(dim, dim, dtype=torch.float64, device=device) if with_gain else None
        self.stream_target = 0.0
        self.stream_norm = 0.0

    def update(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor | None = None,
        stream: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
    ) -> None:
        """Adds the tokens of (batch, seq, dim) `inputs` M and `targets` R whose mask is 1 (and of the residual
        stream Y, which the statistics need when they were built `with_gain`).

        With `offset`, the targets are ``targets − offset`` (ReplaceMe's L − Y), formed here a chunk of rows at a
        time in float64: the caller then makes no float64 copy of a whole batch (at LLaMA-2-7B's shape two of them,
        the difference and Y's upcast, would be 1 GiB). The values are those of the whole-batch difference, bit for
        bit: each element is the same float64 subtraction.
        """
        if self.with_gain and stream is None:
            raise ValueError("statistics built with_gain need the residual stream of every batch (stream=...).")
        m = inputs.reshape(-1, inputs.shape[-1])
        r = targets.reshape(-1, targets.shape[-1])
        y = None if stream is None or not self.with_gain else stream.reshape(-1, stream.shape[-1])
        o = None if offset is None else offset.reshape(-1, offset.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1).to(m.device).bool()
            m, r = m[keep], r[keep.to(r.device)]
            shared = o is not None and y is not None and offset is stream  # one masked copy serves both
            y = None if y is None else y[keep.to(y.device)]
            o = y if shared else None if o is None else o[keep.to(o.device)]
        rows, width = m.shape[0], self.gram.shape[0]
        stream = 0 if y is None else flops.gram(rows, width, y.shape[1])
        flops.record(flops.gram(rows, width) + flops.gram(rows, width, self.cross.shape[1]) + stream, "float64")
        for start in range(0, m.shape[0], UPDATE_CHUNK_ROWS):
            rows = slice(start, start + UPDATE_CHUNK_ROWS)
            m_rows = m[rows].to(self.gram.device, torch.float64)
            if self.intercept:
                m_rows = torch.cat([m_rows, m_rows.new_ones(m_rows.shape[0], 1)], dim=1)
            r_rows = r[rows].to(self.gram.device, torch.float64)
            if o is not None:
                r_rows = r_rows - o[rows].to(self.gram.device, torch.float64)  # not in place: r may be float64 already
            self.gram.addmm_(m_rows.T, m_rows)
            self.cross.addmm_(m_rows.T, r_rows)
            self.target_norm += float((r_rows * r_rows).sum())
            if y is not None:
                y_rows = y[rows].to(self.gram.device, torch.float64)
                self.stream_cross.addmm_(m_rows.T, y_rows)
                self.stream_target += float((y_rows * r_rows).sum())
                self.stream_norm += float((y_rows * y_rows).sum())
        self.count += m.shape[0]


@dataclass
class SolveInfo:
    """How a least-squares solve went: the jitter that made the Gram matrix positive definite."""

    jitter: float
    attempts: int


def solve_least_squares(
    stats: LinearMapStatistics, relative_jitter: float | None = None, max_attempts: int = 12
) -> tuple[torch.Tensor, SolveInfo]:
    """T (dim, out_dim) float64 minimising Σ‖m T − r‖² from the accumulated statistics, by Cholesky with jitter
    (with an intercept, T has one more row: the bias).

    The jitter starts at `relative_jitter` times the mean diagonal of MᵀM; the default, dim · eps(float64), is the
    rounding level of the Gram matrix itself, so a well-posed fit is the exact least-squares answer. It grows tenfold
    until the factorisation succeeds, so a rank-deficient M (a dead channel) gives a ridge solution, not an error.

    Raises:
        ValueError: when no token was accumulated.
    """
    factor, info = _jittered_cholesky(stats, relative_jitter, max_attempts)
    flops.record(flops.cholesky_solve(*stats.cross.shape), "float64", "factorisation")
    return torch.cholesky_solve(stats.cross, factor), info


def solve_diagonal(stats: LinearMapStatistics, relative_jitter: float | None = None) -> tuple[torch.Tensor, SolveInfo]:
    """The diagonal T (dim × dim, float64) minimising Σ‖m T − r‖²: channel j alone, ``t_j = (mᵀr)_jj / (mᵀm)_jj``.

    The map a family can hold where only a per-channel gain follows the MLP (a norm after it: Gemma, OLMo-2,
    GLM-4). Each channel is shrunk towards 1 by λ = `relative_jitter` (default dim · eps(float64), the Gram
    matrix's rounding level) times the mean diagonal: ``t_j = ((mᵀr)_jj + λ) / ((mᵀm)_jj + λ)``, so a channel the
    calibration never excited keeps its gain instead of losing it, and a well-excited one gets the exact answer.

    Raises:
        ValueError: when no token was accumulated.
    """
    if stats.count == 0:
        raise ValueError("no calibration token reached the linear-map statistics (are all tokens masked?).")
    if relative_jitter is None:
        relative_jitter = stats.gram.shape[0] * torch.finfo(torch.float64).eps
    gram, cross = stats.gram.diagonal(), stats.cross.diagonal()
    ridge = relative_jitter * float(gram.mean().clamp_min(torch.finfo(torch.float64).tiny))
    return torch.diag((cross + ridge) / (gram + ridge)), SolveInfo(jitter=ridge, attempts=1)


def solve_least_squares_with_gain(
    stats: LinearMapStatistics, relative_jitter: float | None = None, max_attempts: int = 12
) -> tuple[torch.Tensor, float, SolveInfo]:
    """(T, α) minimising Σ‖α y + m T − l‖² over tokens, with R = L − Y accumulated as the target: the map of
    `solve_least_squares` plus one scalar gain α on the residual stream at the cut.

    With β = α − 1 the target is R − βY, so for a fixed β the best map is ``T(β) = T₀ − β B`` (T₀ = G⁻¹MᵀR,
    B = G⁻¹MᵀY, G = MᵀM), and the residual ``(R − M T₀) − β (Y − M B)`` is linear in β. Its minimiser is
    ``β = ⟨Y − M B, R − M T₀⟩ / ‖Y − M B‖²``; because G B = MᵀY and G T₀ = MᵀR, the two inner products reduce to
    ``⟨Y, R⟩ − ⟨MᵀY, T₀⟩`` and ``⟨Y, Y⟩ − ⟨MᵀY, B⟩`` (Frobenius), so no token matrix is needed. Both solves share
    one jittered Cholesky factor.

    Raises:
        ValueError: when the statistics were not built `with_gain`, or no token was accumulated.
    """
    if not stats.with_gain or stats.stream_cross is None:
        raise ValueError("solve_least_squares_with_gain needs statistics built with with_gain=True.")
    factor, info = _jittered_cholesky(stats, relative_jitter, max_attempts)
    flops.record(flops.cholesky_solve(stats.cross.shape[0], 2 * stats.cross.shape[1]), "float64", "factorisation")
    solved = torch.cholesky_solve(torch.cat([stats.cross, stats.stream_cross], dim=1), factor)
    base, along = solved[:, : stats.cross.shape[1]], solved[:, stats.cross.shape[1] :]
    numerator = stats.stream_target - float((stats.stream_cross * base).sum())
    denominator = stats.stream_norm - float((stats.stream_cross * along).sum())
    if not denominator > 0:
        # Y lies in the span of M: the gain is not identifiable and the map alone fits as well as any (β = 0).
        return base, 1.0, info
    beta = numerator / denominator
    return base - beta * along, 1.0 + beta, info


def _jittered_cholesky(
    stats: LinearMapStatistics, relative_jitter: float | None, max_attempts: int
) -> tuple[torch.Tensor, SolveInfo]:
    """The Cholesky factor of MᵀM + jitter·I, the jitter grown tenfold from its start until it succeeds."""
    if stats.count == 0:
        raise ValueError("no calibration token reached the linear-map statistics (are all tokens masked?).")
    return _jittered_factor(stats.gram, relative_jitter, max_attempts)


def _jittered_factor(
    gram: torch.Tensor, relative_jitter: float | None = None, max_attempts: int = 12, shift: float = 0.0
) -> tuple[torch.Tensor, SolveInfo]:
    """The Cholesky factor of `gram` + (shift + jitter)·I (see `solve_least_squares` for the jitter's start and
    growth; `shift` is a ridge). The diagonal is shifted in place and restored (`cholesky_shifted_in_place`): the
    factor is the only (dim x dim) matrix it allocates."""
    scale = float(gram.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny))
    flops.record_host_reads(1)
    if relative_jitter is None:
        relative_jitter = gram.shape[0] * torch.finfo(torch.float64).eps
    jitters, jitter = [], relative_jitter * scale
    for _ in range(max_attempts):
        jitters.append(jitter)
        jitter *= 10.0
    found = cholesky_shifted_in_place(gram, shift, jitters)
    if found is None:
        raise RuntimeError(
            f"the Gram matrix of the MLP outputs stayed singular after jitter {jitter:.3g}; the calibration tokens do "
            "not determine a linear map (too few tokens, or all equal)."
        )
    factor, used, attempt = found
    return factor, SolveInfo(jitter=used, attempts=attempt)


#: Ridge strengths tried by `fit_towards_prior`, relative to the mean diagonal of the fitting part's Gram matrix;
#: ``inf`` is the prior itself. A geometric grid from "the plain refit" to "the prior", three steps a decade.
RIDGE_GRID = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0, 100.0, float("inf"))


@dataclass
class RidgeChoice:
    """What `fit_towards_prior` chose: the relative ridge, the held-out error of every ridge tried, relative to the
    held-out targets' ‖R‖² (None: no held-out part, so the ridge was not chosen), and the final solve's jitter."""

    ridge: float
    held_out_errors: dict[float, float] | None
    jitter: float


def ridge_towards(
    gram: torch.Tensor, cross: torch.Tensor, prior: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, SolveInfo]:
    """W minimising ``‖A W − R‖² + λ s ‖W − P‖²`` from ``G = AᵀA`` and ``C = AᵀR``: ``(G + λ s I)⁻¹ (C + λ s P)``.

    s is the mean diagonal of G, so `ridge` (λ) is relative to the inputs' scale; ``λ = inf`` returns the prior P and
    ``λ = 0`` the least-squares solution (with `solve_least_squares`'s jitter).
    """
    if ridge == float("inf"):
        return prior.clone(), SolveInfo(jitter=float("inf"), attempts=0)
    scale = float(gram.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny))
    flops.record(flops.cholesky_solve(*cross.shape), "float64", "factorisation")
    if ridge == 0.0:
        factor, info = _jittered_factor(gram)
        return torch.cholesky_solve(cross, factor), info
    factor, info = _jittered_factor(gram, shift=ridge * scale)
    return torch.cholesky_solve(cross + (ridge * scale) * prior, factor), info


def fit_towards_prior(
    fit: LinearMapStatistics,
    held_out: LinearMapStatistics | None,
    prior_of: Callable[[LinearMapStatistics], torch.Tensor],
    ridges: Sequence[float] = RIDGE_GRID,
) -> tuple[torch.Tensor, RidgeChoice]:
    """The least-squares W shrunk towards a prior by the ridge that predicts held-out tokens best, refitted on all.

    Every ridge λ in `ridges` is fitted on `fit` (its prior ``prior_of(fit)``) and scored on `held_out` by the
    squared error ``tr(Wᵀ G_h W) − 2 tr(Wᵀ C_h) + ‖R_h‖²`` (reported relative to ``‖R_h‖²``), so no held-out token
    is needed beyond its statistics. The best λ (the larger on a tie: the simpler model) is then fitted on both
    parts together, towards ``prior_of`` of both. One ridge given is used as it is; without a held-out part, λ is 0.

    `fit` is changed in place (it ends as the sum of both parts).
    """
    errors: dict[float, float] | None = None
    ridge = ridges[0] if len(ridges) == 1 else 0.0
    if len(ridges) > 1 and held_out is not None and held_out.count > 0 and fit.count > 0:
        prior = prior_of(fit)
        errors = {}
        for candidate in ridges:
            solution, _ = ridge_towards(fit.gram, fit.cross, prior, candidate)
            error = (solution * (held_out.gram @ solution)).sum() - 2 * (solution * held_out.cross).sum()
            errors[candidate] = (float(error) + held_out.target_norm) / max(held_out.target_norm, 1e-300)
        best = min(errors.values())
        ridge = max(r for r, e in errors.items() if e == best)
        fit.gram += held_out.gram
        fit.cross += held_out.cross
        fit.count += held_out.count
        fit.target_norm += held_out.target_norm
    if fit.count == 0:
        raise ValueError("no calibration token reached the linear-map statistics (are all tokens masked?).")
    solution, info = ridge_towards(fit.gram, fit.cross, prior_of(fit), ridge)
    return solution, RidgeChoice(ridge=ridge, held_out_errors=errors, jitter=info.jitter)


def folded_map_prior(lifted: torch.Tensor) -> Callable[[LinearMapStatistics], torch.Tensor]:
    """ReplaceMe's answer in the coordinates of a refitted linear layer, as a prior for `fit_towards_prior`.

    `lifted` is the layer as rows act on it (``(in [+1], out)``: ``Wᵀ`` with the bias as the last row), so its
    output is ``M = A · lifted``. From the statistics of A alone, ``MᵀM = liftedᵀ G lifted`` and
    ``MᵀR = liftedᵀ C``: T is ReplaceMe's least-squares map on the same tokens and ``lifted · T`` the layer with T
    folded in.
    """
    lifted = lifted.double()

    def prior_of(stats: LinearMapStatistics) -> torch.Tensor:
        lifted_here = lifted.to(stats.gram.device)
        gram = lifted_here.T @ stats.gram @ lifted_here
        factor, _ = _jittered_factor(gram)
        return lifted_here @ torch.cholesky_solve(lifted_here.T @ stats.cross, factor)

    return prior_of


@dataclass
class CosineFit:
    """Result of the cosine objective: the map and the mean cosine distance before and after."""

    transform: torch.Tensor
    steps: int
    loss_before: float
    loss_after: float


def fit_cosine(
    inputs: Sequence[torch.Tensor],
    residuals: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    epochs: int = 10,
    lr: float = 1e-4,
    minibatch: int = 1024,
    seed: int = 0,
    initial: torch.Tensor | None = None,
) -> CosineFit:
    """T minimising the mean over tokens of ``1 − cos(m T + y, l)``, by Adam on shuffled token minibatches.

    Args:
        inputs, residuals, targets: Row-aligned (tokens, dim) float32 matrices M, Y and L, one per chunk (padding
            already removed).
        epochs: Passes over all tokens; the number of optimizer steps (reported) is epochs x ceil(tokens/minibatch).
        lr, minibatch: Adam's step size and the tokens per step (ReplaceMe's public setting: 1e-4, 1024).
        seed: Seeds the token shuffle, so a fit is reproducible.
        initial: Starting T (default the identity, which leaves the MLP as it was).
    """
    m = torch.cat([x.float() for x in inputs])
    y = torch.cat([x.float() for x in residuals]).to(m.device)
    target = torch.cat([x.float() for x in targets]).to(m.device)
    n, dim = m.shape
    if n == 0:
        raise ValueError("no calibration token reached the cosine fit (are all tokens masked?).")
    start = torch.eye(dim, device=m.device) if initial is None else initial.to(m.device, torch.float32)
    transform = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([transform], lr=lr)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def loss_of(t: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        pred = m[rows] @ t + y[rows]
        return (1.0 - torch.nn.functional.cosine_similarity(pred, target[rows], dim=-1, eps=1e-8)).mean()

    with torch.no_grad():
        before = float(loss_of(start, slice(None)))
    steps = 0
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(m.device)
            for chunk in order.split(minibatch):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_of(transform, chunk)
                loss.backward()
                optimizer.step()
                steps += 1
    result = transform.detach()
    with torch.no_grad():
        after = float(loss_of(result, slice(None)))
    return CosineFit(transform=result.double(), steps=steps, loss_before=before, loss_after=after)


def fold_map_into_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, transform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W', b') with ``W' a + b' = Tᵀ (W a + b)``: the row-vector map T applied after the layer, folded into it.

    Computed in float64; the caller casts to the layer's dtype.
    """
    t = transform.double()
    flops.record(flops.product(t.shape[1], t.shape[0], weight.shape[1]), "float64")
    new_weight = t.T @ weight.double()
    new_bias = None if bias is None else bias.double() @ t
    return new_weight, new_bias
