import torch

import tiny_models
from common import assert_close, sample_ids
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


def test_second_moment_of_float32_tokens_is_centred_so_small_directions_survive_a_large_mean():
    # Tokens = a large shared offset plus small variation: an uncentred float32 product loses the variation.
    g = torch.Generator().manual_seed(1)
    tokens = (1000.0 + 1e-2 * torch.randn(4096, 4, generator=g, dtype=torch.float64)).float()
    exact = tokens.double().T @ tokens.double() / tokens.shape[0]
    moment = SecondMoment(4)
    for chunk in tokens.split(1000):
        moment.update(chunk[None], None)
    centred_exact = exact - torch.outer(tokens.double().mean(0), tokens.double().mean(0))
    centred_ours = moment.mean() - torch.outer(tokens.double().mean(0), tokens.double().mean(0))
    torch.testing.assert_close(centred_ours, centred_exact, rtol=1e-4, atol=1e-9)
    naive = (tokens.T @ tokens).double() / tokens.shape[0]
    naive_centred = naive - torch.outer(tokens.double().mean(0), tokens.double().mean(0))
    assert (naive_centred - centred_exact).abs().max() > 100 * (centred_ours - centred_exact).abs().max()
