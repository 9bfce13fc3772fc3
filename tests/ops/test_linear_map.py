"""The fitted linear map: statistics and solves against torch.linalg.lstsq, the fold against applying the map."""

from __future__ import annotations

import torch

from optimum_flatten.ops.linear_map import (
    LinearMapStatistics,
    fit_cosine,
    fold_map_into_linear,
    solve_least_squares,
)


def test_masked_statistics_solve_matches_lstsq_on_the_real_tokens():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(3, 20, 8, generator=g, dtype=torch.float64) * torch.logspace(0, 2, 8, dtype=torch.float64)
    r = torch.randn(3, 20, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, :5] = 0
    stats = LinearMapStatistics(8)
    for b in range(3):  # one batch at a time, as the calibration loop feeds it
        stats.update(m[b : b + 1], r[b : b + 1], mask[b : b + 1])
    transform, info = solve_least_squares(stats)
    keep = mask.bool()
    expected = torch.linalg.lstsq(m[keep], r[keep]).solution
    assert stats.count == int(mask.sum())
    assert info.attempts == 1
    torch.testing.assert_close(transform, expected, atol=1e-8, rtol=1e-8)


def test_an_offset_target_is_the_whole_batch_difference_bit_for_bit():
    """``update(m, l, mask, offset=y)`` (L − Y formed a chunk at a time, the streamed fit's form) against the caller
    forming ``l − y`` in float64 for the whole batch: the same sums exactly, with the stream's terms and padding."""
    g = torch.Generator().manual_seed(3)
    m, y, target = (torch.randn(2, 9, 6, generator=g) for _ in range(3))  # float32, as a model's states
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    chunked, whole = LinearMapStatistics(6, with_gain=True), LinearMapStatistics(6, with_gain=True)
    chunked.update(m, target, mask, stream=y, offset=y)
    whole.update(m, target.double() - y.double(), mask, stream=y)
    for name in ("gram", "cross", "stream_cross"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert (chunked.count, chunked.target_norm, chunked.stream_target, chunked.stream_norm) == (
        whole.count,
        whole.target_norm,
        whole.stream_target,
        whole.stream_norm,
    )


def test_a_dead_channel_gets_jitter_instead_of_an_error():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(50, 6, generator=g, dtype=torch.float64)
    m[:, 2] = 0.0  # a channel that is never active: MᵀM is singular
    r = torch.randn(50, 6, generator=g, dtype=torch.float64)
    stats = LinearMapStatistics(6)
    stats.update(m, r)
    transform, info = solve_least_squares(stats)
    assert torch.isfinite(transform).all()
    assert info.attempts >= 1
    # The live channels still get the least-squares answer of the reduced problem.
    live = [0, 1, 3, 4, 5]
    expected = torch.linalg.lstsq(m[:, live], r).solution
    torch.testing.assert_close(transform[live], expected, atol=1e-6, rtol=1e-6)


def test_fold_equals_applying_the_map_after_the_layer():
    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(5, 7, dtype=torch.float64)
    transform = torch.randn(7, 7, generator=g, dtype=torch.float64)
    a = torch.randn(11, 5, generator=g, dtype=torch.float64)
    weight, bias = fold_map_into_linear(layer.weight.data, layer.bias.data, transform)
    torch.testing.assert_close(a @ weight.T + bias, layer(a) @ transform, atol=1e-12, rtol=1e-12)
    weight_nb, bias_nb = fold_map_into_linear(layer.weight.data, None, transform)
    assert bias_nb is None
    torch.testing.assert_close(a @ weight_nb.T, (a @ layer.weight.data.T) @ transform, atol=1e-12, rtol=1e-12)


def test_cosine_fit_lowers_the_cosine_distance_in_the_stated_number_of_steps():
    g = torch.Generator().manual_seed(3)
    true = torch.eye(6) + 0.3 * torch.randn(6, 6, generator=g)
    m = torch.randn(300, 6, generator=g)
    y = 0.2 * torch.randn(300, 6, generator=g)
    target = m @ true + y
    fit = fit_cosine(
        [m[:100], m[100:]], [y[:100], y[100:]], [target[:100], target[100:]], epochs=30, lr=1e-2, minibatch=64
    )
    assert fit.steps == 30 * 5  # ceil(300 / 64) = 5 steps an epoch
    assert fit.loss_after < 0.2 * fit.loss_before
    again = fit_cosine([m], [y], [target], epochs=30, lr=1e-2, minibatch=64)
    torch.testing.assert_close(again.transform, fit.transform)  # same seed, same token order
