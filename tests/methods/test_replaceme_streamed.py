"""ReplaceMe's fit streamed batch by batch (issue 31, item 3) against the held path it replaces.

The streamed fit walks the dense stack one batch at a time and adds each batch to the float64 statistics; the held
path keeps the dense targets and the propagated states of every batch and runs the bridged layer over them. Both add
the same batches in the same order, so the maps agree to float round-off; padded tokens must be left out by both.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import TOLERANCES, compress, decoder_layers, mlp_parts, naive_least_squares_map, padded_batches, tiny_config
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext, apply_layer_drop_
from optimum_flatten.corrections.linear_bridge import bridged_apply_, streamed_span
from optimum_flatten.options.corrections import BridgeOptions
from optimum_flatten.plan import LayerPlan


def _batches() -> list[CalibrationBatch]:
    """Three batches of 2 x 16 tokens; the second right-pads 5 tokens of a row (so a padded token that leaked into
    the statistics would change the map), and the last is the held-out batch of ``lstsq_down``'s ridge."""
    return padded_batches(3, seed=11, padded=(1, 0, 5))


def _bridge(model, plan: LayerPlan, options: BridgeOptions, stream: bool) -> dict:
    adapter = get_adapter(model)
    context = MethodContext(batches=_batches(), progress=False)
    return bridged_apply_(adapter, plan, context, options, lambda: apply_layer_drop_(adapter, plan), stream=stream)


@pytest.mark.parametrize(
    ("factory", "estimator"),
    [(f, e) for f in ("llama_gqa", "qwen2") for e in ("lstsq", "lstsq_gain", "lstsq_down")]
    + [(f, e) for f in ("mixtral", "qwen2_moe") for e in ("lstsq", "lstsq_gain")],  # no one down projection to refit
)
def test_streamed_fit_equals_the_held_fit_with_padding(factory, estimator):
    model = tiny_models.FACTORIES[factory]()
    held = copy.deepcopy(model)
    plan = LayerPlan.from_kept(6, [0, 1, 2, 5], stack="decoder")  # layer 2 bridges [3, 5)
    options = BridgeOptions(estimator)
    assert streamed_span(get_adapter(model), plan, options) == (2, 2, 5)

    streamed_report = _bridge(model, plan, options, stream=True)
    held_report = _bridge(held, plan, options, stream=False)
    assert streamed_report["states"] == "streamed" and held_report["states"] == "held"
    (streamed_entry,) = streamed_report["maps"]
    (held_entry,) = held_report["maps"]
    assert streamed_entry["tokens"] == held_entry["tokens"] == 3 * 2 * 16 - 5
    assert streamed_entry["span"] == held_entry["span"] == [2, 5]
    if estimator == "lstsq_gain":
        assert streamed_entry["gain"] == pytest.approx(held_entry["gain"], rel=1e-12)
    if estimator == "lstsq_down":
        assert streamed_entry["ridge"] == held_entry["ridge"]
    # Every weight (the gain is folded into the embeddings and every writer of the stream up to the bridge).
    atol, rtol = TOLERANCES[torch.float32]
    held_weights = dict(held.named_parameters())
    for name, weight in model.named_parameters():
        torch.testing.assert_close(weight, held_weights[name], atol=atol / 100, rtol=rtol / 100, msg=name)


def test_streamed_fit_equals_the_naive_least_squares_map_with_padding():
    """The streamed statistics against `torch.linalg.lstsq` on the real tokens' rows (padding dropped)."""
    model = tiny_models.FACTORIES["llama_mha"]()
    original = copy.deepcopy(model)
    plan = LayerPlan.from_kept(6, [0, 1, 4, 5], stack="decoder")
    report = _bridge(model, plan, BridgeOptions("lstsq"), stream=True)
    assert report["states"] == "streamed" and report["maps"][0]["span"] == [1, 4]
    transform = naive_least_squares_map(original, _batches(), 1, 4)
    _, _, before = mlp_parts(decoder_layers(original)[1])
    _, _, after = mlp_parts(decoder_layers(model)[1])
    torch.testing.assert_close(after().double(), transform.T @ before().double(), atol=2e-5, rtol=1e-4)


def test_what_streams_and_what_is_held():
    """ReplaceMe's own case streams (one bridge after an unchanged prefix); the cosine fit, two bridges and a bridge
    after a dropped leading layer hold their states, and asking them to stream is refused."""
    model = tiny_models.FACTORIES["llama_gqa"]()
    adapter = get_adapter(model)
    one = LayerPlan.from_kept(6, [0, 1, 4, 5], stack="decoder")
    two = LayerPlan.from_kept(6, [0, 2, 4, 5], stack="decoder")
    leading = LayerPlan.from_kept(6, [1, 2, 4, 5], stack="decoder")
    assert streamed_span(adapter, one, BridgeOptions("lstsq")) == (1, 1, 4)
    assert streamed_span(adapter, one, BridgeOptions("cosine")) is None
    assert streamed_span(adapter, two, BridgeOptions("lstsq")) is None
    assert streamed_span(adapter, leading, BridgeOptions("lstsq")) is None
    assert streamed_span(adapter, one, BridgeOptions("lstsq", correct_after=1)) is None  # a second, kept, span
    with pytest.raises(ValueError, match=r"cannot stream.*'cosine'"):
        _bridge(model, one, BridgeOptions("cosine"), stream=True)

    config = tiny_config("replaceme", num_layers_to_remove=2, held_states_gb=0)  # no state held by the selection
    streamed = compress(tiny_models.FACTORIES["llama_gqa"](), config)
    assert streamed.report["replaceme"]["states"] == "streamed"
    held = compress(
        tiny_models.FACTORIES["llama_gqa"](),
        tiny_config("replaceme", num_layers_to_remove=2, estimator="cosine", cosine_epochs=1),
    )
    assert held.report["replaceme"]["states"] == "held"


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("estimator", ["lstsq", "lstsq_gain", "lstsq_down"])
def test_states_held_by_the_selection_give_the_streamed_map(estimator, packing):
    """With the window within `held_states_gb` the selection walk keeps the states around the best block, and the
    fit runs the layer before it on them instead of walking the dense stack again: the same plan and, the same runs
    in the same order, the same weights bit for bit; fewer stack passes (the walk up to the block's end becomes one
    layer's run). Unpacked calibration pads rows, which both must leave out."""
    model = tiny_models.FACTORIES["llama_gqa"]()
    streamed = copy.deepcopy(model)
    options = {"estimator": estimator, "num_layers_to_remove": 2, "packing": packing, "batch_size": 3}
    held_report = compress(model, "replaceme", **options).report
    streamed_report = compress(streamed, "replaceme", held_states_gb=0, **options).report
    assert held_report["held_states"] and "held_states" not in streamed_report  # a budget of 0: never asked
    assert held_report["replaceme"]["states"] == "held by the selection"
    assert streamed_report["replaceme"]["states"] == "streamed"
    assert held_report["plan_summary"] == streamed_report["plan_summary"]
    streamed_weights = dict(streamed.named_parameters())
    for name, weight in model.named_parameters():
        assert torch.equal(weight, streamed_weights[name]), name
    (_, end) = held_report["blocks"][0]
    layers = model.config.num_hidden_layers + 2  # before compression
    passes = held_report["cost"]["stack_passes"], streamed_report["cost"]["stack_passes"]
    assert passes[1] - passes[0] == pytest.approx((end - 1) / layers, abs=1e-3)  # layers 0..end-1, less layer start-1


def test_the_held_window_follows_its_budget():
    """Over budget (size + 4 copies of the calibration states) the walk holds nothing and the fit streams."""
    model = tiny_models.FACTORIES["llama_gqa"]()
    report = compress(model, "replaceme", num_layers_to_remove=2, held_states_gb=1e-6).report
    assert report["held_states"] is False and report["replaceme"]["states"] == "streamed"
