"""FlattenGPT's cheaper paths give the reference path's result.

- the default float32 statistics (`covariance_dtype="float32"`) against the float64 reference: same plan, same kept
  KV groups and MLP channels, every weight within 1e-4 of the tensor's largest entry;
- the one-pass application from the selection's cached inputs (full similarity band) against propagating the
  original model again (band 1): the same, within 1e-5;
- `run_to_input` hands the hook exactly what a full forward hands it, and counts only the weights that ran.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.calibration import LayerwiseRunner, build_calibration_batches
from optimum_flatten.calibration.capture import capture_module_inputs
from optimum_flatten.calibration.partial import run_to_input, weights_run
from optimum_flatten.methods.flattengpt import FlattenGPTMethod


def _report(model, **options):
    return compress(model, "flattengpt", num_layers_to_remove=2, batch_size=4, **options).report


def _kept(report):
    return [(g["members"], g["kept_kv_groups"], g["kept_channels_per_member"]) for g in report["groups"]]


def _max_relative_difference(a, b) -> float:
    first, second = a.state_dict(), b.state_dict()
    assert first.keys() == second.keys()
    return max(
        float((first[k].double() - second[k].double()).abs().max() / second[k].double().abs().max().clamp_min(1e-30))
        for k in first
    )


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_float32_statistics_match_the_float64_reference(factory):
    model = tiny_models.FACTORIES[factory]()
    reference = copy.deepcopy(model)
    fast_report = _report(model)
    slow_report = _report(reference, covariance_dtype="float64")
    assert fast_report["plan_summary"] == slow_report["plan_summary"]
    assert _kept(fast_report) == _kept(slow_report)
    assert _max_relative_difference(model, reference) <= 1e-4


@pytest.mark.parametrize("mode", ["one_pass", "sequential"])
def test_cached_inputs_match_propagating_the_original_model(mode):
    model = tiny_models.tiny_llama_gqa()
    model_layers_before = model.config.num_hidden_layers
    propagated = copy.deepcopy(model)
    cached_report = _report(model, calibration_mode=mode)
    propagated_report = _report(propagated, calibration_mode=mode, similarity_band=1)
    assert cached_report["similarity_band"] == model.config.num_hidden_layers + 2  # the whole (original) stack
    assert propagated_report["similarity_band"] == 1
    assert _kept(cached_report) == _kept(propagated_report)
    assert _max_relative_difference(model, propagated) <= 1e-5
    if mode == "one_pass":
        assert "propagate" not in cached_report["timings_seconds"]
        # Without the cache only the kept layers run again: a merged pair's original outputs, computed for the MLP's
        # target, are its propagation (the tiny model's layers are all the same size). With it, a pair that does not
        # end the stack reads its targets from the cached states: its members run only up to their MLP norms.
        kept_layers = sum(1 for g in propagated_report["plan"]["groups"] if len(g) == 1)
        layer = propagated.model.layers[0]
        after_attention = weights_run(layer, [layer.post_attention_layernorm, layer.mlp]) / weights_run(layer, [])
        spared = sum(
            len(g) * (1 - after_attention)
            for g in cached_report["plan"]["groups"]
            if len(g) > 1 and g[-1] + 1 < model_layers_before
        )
        assert spared > 0  # the plan has a pair inside the stack: the test reads the cache
        extra = propagated_report["cost"]["stack_passes"] - cached_report["cost"]["stack_passes"]
        assert extra == pytest.approx((kept_layers + spared) / model_layers_before, abs=2e-3)
    else:
        assert cached_report["cost"]["stack_passes"] == propagated_report["cost"]["stack_passes"]


def test_both_sequential_targets_run_the_members_once(monkeypatch):
    """Without the selection's cache (a band of 1) the defaults' two sequential targets take the attention writes and
    the group's outputs from one run of the members: the merged pair's attentions run once less per batch than when
    the MLP's target runs them again, and the model is the same (to the bit: the same runs, in the same order)."""
    options = {"similarity_band": 1}

    def attention_calls(model, route):
        calls: dict[int, int] = {}
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_pre_hook(
                lambda *_, index=index: calls.__setitem__(index, calls.get(index, 0) + 1)
            )
        with monkeypatch.context() as patch:
            if route == "two runs":  # the MLP's target runs the members again, as before one run served both
                heads, channels = FlattenGPTMethod._prune_heads, FlattenGPTMethod._prune_channels
                patch.setattr(FlattenGPTMethod, "_prune_heads", lambda self, g, kv, *_: heads(self, g, kv))
                patch.setattr(
                    FlattenGPTMethod,
                    "_prune_channels",
                    lambda self, g, width, outputs=None, *_: channels(self, g, width, outputs),
                )
            report = compress(model, "flattengpt", num_layers_to_remove=1, batch_size=4, **options).report
        return calls, report

    model = tiny_models.tiny_llama_gqa()
    reference = copy.deepcopy(model)
    once, report = attention_calls(model, "one run")
    twice, reference_report = attention_calls(reference, "two runs")
    (members,) = [g["members"] for g in report["groups"]]
    batches = 2  # 8 calibration sequences in batches of 4
    assert [twice[i] - once[i] for i in members] == [batches, batches]
    assert all(twice[i] == once[i] for i in once if i not in members)
    assert report["cost"]["stack_passes"] < reference_report["cost"]["stack_passes"]
    assert _kept(report) == _kept(reference_report)
    assert _max_relative_difference(model, reference) == 0.0


def test_cached_states_spare_the_members_mlps(monkeypatch):
    """With the selection's cache (the defaults on a small model) the sequential targets read the original states it
    holds: after the selection no merged member's MLP runs, each member's attention runs once per batch, and the
    model is the one the members' run gives (`member_states` patched to nothing) to the cache's rounding."""

    def calls(model, read_cache):
        mlps: dict[int, int] = {}
        attentions: dict[int, int] = {}

        def counter(counts, index, original):
            # Copies of a layer (the wide block, the members' copies) carry its hooks: only the layer itself counts.
            def count(module, _args):
                if module is original:
                    counts[index] = counts.get(index, 0) + 1

            return count

        for index, layer in enumerate(model.model.layers):
            layer.mlp.register_forward_pre_hook(counter(mlps, index, layer.mlp))
            layer.self_attn.register_forward_pre_hook(counter(attentions, index, layer.self_attn))
        with monkeypatch.context() as patch:
            if not read_cache:
                patch.setattr(FlattenGPTMethod, "member_states", lambda self, indices, num_layers: ())
            report = _report(model)
        return mlps, attentions, report

    model = tiny_models.tiny_llama_gqa()
    reference = copy.deepcopy(model)
    num_layers = model.config.num_hidden_layers
    mlps, attentions, report = calls(model, True)
    ran_mlps, _, reference_report = calls(reference, False)
    inside = [g["members"] for g in report["groups"] if g["members"][-1] + 1 < num_layers]
    assert inside  # a merged group the cache can serve
    batches = 2  # 8 calibration sequences in batches of 4
    for members in inside:
        # The selection ran every layer but the last once; the members' run would add one per batch.
        assert [mlps.get(i, 0) for i in members] == [batches] * len(members)
        assert [ran_mlps[i] for i in members] == [2 * batches] * len(members)
        assert [attentions[i] for i in members] == [2 * batches] * len(members)
    assert report["cost"]["stack_passes"] < reference_report["cost"]["stack_passes"]
    assert _kept(report) == _kept(reference_report)
    assert _max_relative_difference(model, reference) <= 1e-5


def test_run_to_input_captures_what_a_full_run_sees():
    model = tiny_models.tiny_llama_gqa()
    adapter = get_adapter(model)
    config = FlattenConfig(num_layers_to_remove=1, dataset=tiny_models.sample_texts(), nsamples=4, seqlen=16)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    runner = LayerwiseRunner(adapter, batches)
    block = adapter.block_view(adapter.layers()[1], 1)
    target = block.mlp.down.module
    full, partial = [], []
    with capture_module_inputs(target, full.append):
        runner.run(block.module, 1, runner.inputs)
    before = runner.work
    run_to_input(runner, block.module, 1, runner.inputs, target, lambda b, x: partial.append((b, x)), [target])
    assert [b for b, _ in partial] == list(range(len(batches)))
    for expected, (_, seen) in zip(full, partial, strict=True):
        assert torch.equal(expected, seen)
    tokens = sum(h.shape[0] * h.shape[1] for h in runner.inputs)
    assert runner.work - before == weights_run(block.module, [target]) * tokens
    assert (
        weights_run(block.module, [target]) == sum(p.numel() for p in block.module.parameters()) - target.weight.numel()
    )
