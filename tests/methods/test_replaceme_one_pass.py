"""ReplaceMe's selection and fit in one walk batch by batch (issue 31, item 3) against the walks it replaces.

With the window of whole boundaries over `held_states_gb` and the statistics of a start within it, the selection walks
the stack one batch at a time and accumulates the fit's statistics for the starts nearest on the first batch
(methods/replaceme_one_pass.py). Whatever the shortlist, the distances, the plan and the weights must be those of
the layer-by-layer walk with the streamed fit, bit for bit; only the stack passes may differ.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, padded_batches
from optimum_flatten import get_adapter
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.corrections.bridge_fit import BridgeFit
from optimum_flatten.corrections.linear_bridge import stream_bridge_statistics_
from optimum_flatten.methods import replaceme_one_pass
from optimum_flatten.methods.replaceme_one_pass import walk_with_shortlist
from optimum_flatten.methods.uidl import walk_block_distances
from optimum_flatten.options.corrections import BridgeOptions
from optimum_flatten.options.methods.replaceme import ReplaceMeConfig

#: Budgets under the tiny calibration's window (size + 4 = 6 copies of 8 × 24 × 32 float32 states, 147 KB) that hold
#: two starts' statistics with "lstsq" and "diagonal" (16 KB each: the diagonal map's sums are the full ones), one with
#: "lstsq_gain" (24 KB) and one with "lstsq_down" (the 48-wide intermediate and its held-out batch's: 60 KB).
BUDGET_GB = {"lstsq": 4e-5, "lstsq_gain": 4e-5, "lstsq_down": 1e-4, "diagonal": 4e-5}
SHORTLISTED = {"lstsq": 2, "lstsq_gain": 1, "lstsq_down": 1, "diagonal": 2}


def _assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    theirs = dict(reference.named_parameters())
    for name, weight in model.named_parameters():
        assert torch.equal(weight, theirs[name]), name


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize(
    ("factory", "estimator"),
    [("llama_gqa", e) for e in ("lstsq", "lstsq_gain", "lstsq_down")]
    + [("mixtral", "lstsq"), ("gemma3_text", "diagonal")],  # a mixture's MLP output; a post-norm's diagonal map
)
def test_one_pass_gives_the_streamed_plan_and_weights(factory, estimator, packing):
    """The distances (as reported), the plan and every weight of the two-walk path, bit for bit, from fewer stack
    passes: the probe batch (1/B) instead of the walk up to the block's end."""
    model = tiny_models.FACTORIES[factory]()
    streamed = copy.deepcopy(model)
    options = {"estimator": estimator, "num_layers_to_remove": 2, "packing": packing, "batch_size": 3}
    report = compress(model, "replaceme", held_states_gb=BUDGET_GB[estimator], **options).report
    streamed_report = compress(streamed, "replaceme", held_states_gb=0, **options).report
    assert report["held_states"] is False  # the window is over the budget
    assert report["replaceme"]["states"] == "one pass with the selection"
    assert streamed_report["replaceme"]["states"] == "streamed"
    one_pass = report["one_pass"]
    assert len(one_pass["shortlist"]) == SHORTLISTED[estimator] and one_pass["chosen_on_shortlist"]
    assert report["block_distances"] == streamed_report["block_distances"]
    assert report["plan_summary"] == streamed_report["plan_summary"]
    _assert_same_weights(model, streamed)
    (_, end) = report["blocks"][0]
    layers = model.config.num_hidden_layers + 2  # before compression
    passes = report["cost"]["stack_passes"], streamed_report["cost"]["stack_passes"]
    # Streamed: the walk and layers 0..end−1 again. One pass: the walk and the probe batch (3 of the 8 packed rows)
    # through every layer. Padded batches are as long as their longest row, so their share is not 3/8.
    if packing:
        assert passes[1] - passes[0] == pytest.approx(end / layers - 3 / 8, abs=1e-3)
    else:
        assert passes[0] < passes[1]


def test_the_walk_measures_the_layer_by_layer_distances_exactly():
    """`walk_with_shortlist` against `uidl.walk_block_distances` on the same runner: the same floats for every
    start, and each shortlisted start's statistics those of a fit over all batches (the streamed walk's)."""
    model = tiny_models.FACTORIES["qwen2"]()
    adapter = get_adapter(model)
    context = MethodContext(batches=padded_batches(3, seed=5, padded=(2, 1, 4)), progress=False)
    states = context.new_states(adapter, keep=())
    layered, _ = walk_block_distances(states, 2, "last", first_start=1)
    options = BridgeOptions("lstsq")

    def new_fit(start: int, device: str = "cpu") -> BridgeFit:
        return BridgeFit(adapter, states.layers[start - 1], start - 1, options, states.num_batches, device)

    walk = walk_with_shortlist(adapter, states, 2, 1, shortlist=3, budget_bytes=1e9, new_fit=new_fit)
    assert walk.distances == layered
    assert len(walk.shortlist) == 3 == len(set(walk.shortlist))
    for start in walk.shortlist:
        reference = new_fit(start)
        stream_bridge_statistics_(adapter, states, start - 1, start + 2, reference)
        assert torch.equal(walk.fits[start].fit.gram, reference.fit.gram)
        assert torch.equal(walk.fits[start].fit.cross, reference.fit.cross)
        assert walk.fits[start].fit.count == reference.fit.count == 3 * 2 * 16 - 4


def test_a_block_off_the_shortlist_streams_its_fit(monkeypatch):
    """A probe that ranks the chosen block last (forced here) leaves it off the shortlist: the fit then streams its
    own walk, and the plan and the weights are still the streamed path's."""
    real = replaceme_one_pass.probe_distances

    def inverted(states, size, first_start):
        return {s: -d for s, d in real(states, size, first_start).items()}

    monkeypatch.setattr(replaceme_one_pass, "probe_distances", inverted)
    model = tiny_models.FACTORIES["llama_gqa"]()
    streamed = copy.deepcopy(model)
    report = compress(model, "replaceme", num_layers_to_remove=2, held_states_gb=4e-5, fit_shortlist=1).report
    streamed_report = compress(streamed, "replaceme", num_layers_to_remove=2, held_states_gb=0).report
    assert report["one_pass"]["chosen_on_shortlist"] is False
    assert report["blocks"][0][0] not in report["one_pass"]["shortlist"]
    assert report["replaceme"]["states"] == "streamed"
    assert report["plan_summary"] == streamed_report["plan_summary"]
    _assert_same_weights(model, streamed)


def test_the_shortlist_follows_its_budget_and_its_option():
    """As many starts as the budget holds, at most `fit_shortlist`; none held and no one-pass walk when not one start's
    statistics fit, or with ``fit_shortlist=0``."""
    report = compress(
        tiny_models.FACTORIES["llama_gqa"](), "replaceme", num_layers_to_remove=2, held_states_gb=1e-4, fit_shortlist=3
    ).report
    assert len(report["one_pass"]["shortlist"]) == 3  # 6 of 16 KB fit in 100 KB; 3 asked
    for options in ({"held_states_gb": 1e-5}, {"held_states_gb": 4e-5, "fit_shortlist": 0}):
        report = compress(tiny_models.FACTORIES["llama_gqa"](), "replaceme", num_layers_to_remove=2, **options).report
        assert "one_pass" not in report and report["replaceme"]["states"] == "streamed"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_a_bad_shortlist_is_refused(bad):
    with pytest.raises(ValueError, match="fit_shortlist must be a whole number"):
        ReplaceMeConfig(fit_shortlist=bad)
