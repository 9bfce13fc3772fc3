import math

import pytest
import torch

import tiny_models
from common import UNIT_ROUNDOFF, assert_close, assert_within, compress, gamma, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch, LayerwiseRunner, SecondMoment


def test_layer_by_layer_states_equal_the_full_forward():
    for factory in ("llama_gqa", "qwen2"):
        model = tiny_models.FACTORIES[factory]()
        ids = sample_ids(batch=2, length=20)
        with torch.no_grad():
            reference = model(input_ids=ids, output_hidden_states=True).hidden_states
        adapter = get_adapter(model)
        runner = LayerwiseRunner(
            adapter,
            [
                CalibrationBatch(ids[:1], torch.ones_like(ids[:1])),
                CalibrationBatch(ids[1:], torch.ones_like(ids[1:])),
            ],
        )
        current = runner.inputs
        for i, layer in enumerate(adapter.layers()):
            assert_close(torch.cat(current), reference[i])
            current = runner.run(layer, i, current)
        # The model's own layers are back in place after recording.
        assert all(type(layer).__name__.endswith("DecoderLayer") for layer in adapter.layers())


def test_second_moment_is_float64_and_skips_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    moment = SecondMoment(3)
    moment.update(x[:1], mask[:1])
    moment.update(x[1:], mask[1:])
    valid = torch.cat([x[0, :2], x[1, :4]]).double()
    assert moment.count == 6
    assert moment.sum.dtype == torch.float64
    assert_close(moment.mean(), valid.T @ valid / 6, dtype=torch.float32)
    exact = SecondMoment(3)
    exact.update(x.double(), mask)
    assert_close(exact.mean(), valid.T @ valid / 6)
    assert_close(exact.finish(), valid.T @ valid / 6)  # in place: the running sum is consumed
    assert exact.sum is None


def test_real_rows_of_a_packed_batch_are_the_batch_itself():
    """Every token real: the rows are a view of the batch (no masked copy), the same values as the masked copy, and a
    moment over them is bit for bit the moment over that copy; with padding the padded rows are left out."""
    from optimum_flatten.calibration.stats import real_rows

    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    packed = torch.ones(2, 5, dtype=torch.long)
    rows = real_rows(x, packed, x.device)
    assert rows.data_ptr() == x.data_ptr() and torch.equal(rows, x.reshape(-1, 3)[packed.reshape(-1).bool()])
    view, copy = SecondMoment(3), SecondMoment(3)
    view.update(x, packed)
    copy.update(x.reshape(-1, 3)[packed.reshape(-1).bool()].reshape(2, 5, 3).clone(), None)
    assert torch.equal(view.mean(), copy.mean())
    padded = packed.clone()
    padded[1, 3:] = 0
    assert torch.equal(real_rows(x, padded, x.device), torch.cat([x[0], x[1, :3]]))
    assert torch.equal(x, torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1)))  # read, never written


def test_second_moment_of_float32_tokens_is_centred_so_small_directions_survive_a_large_mean():
    """Tokens = a large shared offset (1000) plus small variation (0.01): the centred covariance (~1e-4) is what the
    ridge solves need, and an uncentred float32 product loses it (it rounds terms of 1000^2).

    The tolerance is derived from the arithmetic, not tuned on one BLAS. SecondMoment forms, per chunk k of n_k
    tokens, C_k = x - m_k (float32, m_k the chunk mean rounded to float32), the float32 product C_k^T C_k, and adds
    it and the exact correction m s^T + s m^T - n m m^T (s the float64 chunk sum) to a float64 running sum S.
    Premises, all exact here and checked below where cheap: the float64 sums of these float32 values (multiples of
    2^-14 below 2^22, so under 53 bits) and the division by N = 2^12; x - m_k and x - mean (Sterbenz: operands
    within a factor 2 of each other). The error of the float64 mean of S minus mean mean^T, against the exact
    centred moment, is then at most
      * float32 products: sum_k gamma_{n_k}(float32) (|C_k|^T |C_k|) / N  (any summation order, FMA or not);
      * float64: each chunk makes 4 additions to entries of magnitude <= 3 N M (M = max |x_i x_j|, the uncentred
        moment, ~1e6) and 4 roundings of products <= n_k M; with the division and the test's own outer product and
        subtraction, (12 K + 6) u64 M over K chunks;
    plus the error of the two-pass float64 reference, gamma_N(float64) (|c|^T |c|) / N + u64 |reference|, and 1%
    for the second-order terms. That is ~1e-8 here, i.e. 1e-4 of the centred variances: small directions survive.
    The uncentred float32 product misses by ~1e-1 and more, so the test fails for it.
    """
    g = torch.Generator().manual_seed(1)
    tokens = (1000.0 + 1e-2 * torch.randn(4096, 4, generator=g, dtype=torch.float64)).float()
    chunks = tokens.split(1000)
    moment = SecondMoment(4)
    for chunk in chunks:
        moment.update(chunk[None], None)

    x = tokens.double()
    count = x.shape[0]
    total = x.sum(0)
    assert total.tolist() == [math.fsum(column) for column in x.T.tolist()]  # the float64 sum is exact
    mean = total / count  # exact: count = 2^12
    centred = x - mean  # exact (Sterbenz)
    reference = centred.T @ centred / count  # two-pass float64: the centred moment to ~1e-20
    ours = moment.mean() - torch.outer(mean, mean)

    u32, u64 = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[torch.float64]
    float32_products = torch.zeros(4, 4, dtype=torch.float64)
    for chunk in chunks:
        c = (chunk - (chunk.sum(dim=0, dtype=torch.float64) / chunk.shape[0]).float()).double()  # as SecondMoment
        float32_products += gamma(chunk.shape[0], torch.float32) * (c.abs().T @ c.abs())
    largest = float((x.abs().max(0).values[:, None] * x.abs().max(0).values[None, :]).max())
    bound = 1.01 * (
        float32_products / count
        + (12 * len(chunks) + 6) * u64 * largest
        + gamma(count, torch.float64) * (centred.abs().T @ centred.abs()) / count
        + u64 * reference.abs()
    )
    assert_within(ours, reference, bound, "centred second moment")
    assert float(bound.max()) < 1e-3 * float(reference.diagonal().min())  # the bound resolves the variances

    naive = (tokens.T @ tokens).double() / count  # uncentred float32: what centring avoids
    naive_centred = naive - torch.outer(mean, mean)
    assert float((naive_centred - reference).abs().max()) > 1e3 * float(bound.max())
    assert u32 * largest > 1e3 * float(bound.max())  # even one float32 rounding of a term exceeds the bound


@pytest.mark.parametrize("method", ["shortgpt", "replaceme", "flattengpt", "laco"])
def test_states_that_are_not_finite_are_refused_naming_the_layer_before_any_change(method):
    """One NaN weight made every method fail with another message (a tolerance of -nan in validation, a NaN
    turned to an integer, FlattenGPT's advice to raise max_group_size): the runner says what is wrong, where."""
    model = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight[0, 0] = float("nan")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"the states after layer 2 are not finite \(NaN or Inf\)"):
        compress(model, method, num_layers_to_remove=2)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(tensor.nan_to_num(), before[name].nan_to_num()) for name, tensor in after.items())
