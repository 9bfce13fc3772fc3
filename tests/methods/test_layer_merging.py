"""LaCo and Sliding-Window Merging: parameter merges checked against naive references built from copies."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, greedy_generate_both_ways, logits, sample_ids, tiny_config
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.laco import LaCoConfig, LaCoMethod
from optimum_flatten.methods.sliding_window import SlidingWindowConfig, SlidingWindowMethod

FACTORIES = ["llama_gqa", "qwen2", "qwen3"]


def _naive_merged_model(model, groups, rule="differences"):
    """A fresh shallower model whose merged layers are computed by hand from a copy of the original weights."""
    original = {k: v.clone() for k, v in model.state_dict().items()}
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(groups)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [model.config.layer_types[g[0]] for g in groups]
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v for k, v in original.items() if not k.startswith("model.layers.")}
    for new, group in enumerate(groups):
        prefix = f"model.layers.{group[0]}."
        for name, tensor in original.items():
            if not name.startswith(prefix):
                continue
            local = name[len(prefix) :]
            value = tensor
            if local.startswith(("self_attn.", "mlp.")) and len(group) > 1:
                if rule == "differences":
                    value = tensor.clone()
                    for other in group[1:]:
                        value = value + (original[f"model.layers.{other}.{local}"] - tensor)
                else:
                    value = original[f"model.layers.{group[-1]}.{local}"]
            state[f"model.layers.{new}.{local}"] = value
    fresh.load_state_dict(state)
    return fresh


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("rule", ["differences", "reference_code"])
def test_merge_equals_naive_reference_from_copies(factory, rule):
    # The tiny Qwen2's sliding layers start at 3, and a merge across attention types is refused (see the next
    # test): here they start at 4, so the merged layers 1-3 are all full attention.
    model = tiny_models.tiny_qwen2(max_window_layers=4) if factory == "qwen2" else tiny_models.FACTORIES[factory]()
    groups = [(0,), (1, 2, 3), (4,), (5,)]
    reference = _naive_merged_model(model, groups, rule)
    config = tiny_config(
        "laco",
        num_layers_to_remove=2,
        window_size=3,
        threshold=0.01,
        min_layer=1,
        max_layer=3,
        merge_rule=rule,
    )
    quantizer = compress(model, config)
    assert quantizer.plan.group_lists() == [list(g) for g in groups]
    ids = sample_ids()
    assert_close(logits(model, ids), logits(reference, ids))
    with_cache, without_cache = greedy_generate_both_ways(model, ids[:1, :5])
    assert torch.equal(with_cache, without_cache)


def test_a_merge_across_attention_types_is_never_planned_and_refused_before_any_change():
    """LaCo's only window in layers 1-3 mixes full and sliding attention: the target is out of reach, refused before
    calibrating (the search used to score the windows first, and before that planned it and had the plan refused);
    a plan that mixes them is still refused."""
    from optimum_flatten.adapters.per_layer import LayerKindMergeError

    model = tiny_models.tiny_qwen2()  # layers 0-2 full attention, 3-5 sliding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = tiny_config("laco", num_layers_to_remove=2, window_size=3, threshold=0.01, min_layer=1, max_layer=3)
    with pytest.raises(ValueError, match=r"the layer range \[1, 3\] can lose at most 1 that way, fewer than the 2"):
        compress(model, config)
    with pytest.raises(LayerKindMergeError, match=r"cannot merge layers \[1, 2, 3\].*'layer_types'.*sliding"):
        get_adapter(model).check_plan_config("decoder", [[0], [1, 2, 3], [4], [5]])
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("method", "removed", "options"), [("laco", 1, {"window_size": 2}), ("sliding_window", 2, {"min_layer": 0})]
)
def test_the_searches_merge_only_layers_of_one_kind(method, removed, options):
    """SmolLM3 with NoPE on layers 2 and 5: every window the searches took across a NoPE layer had the whole run
    refused, though windows of one kind were there ((3, 4), and (0, 1) from layer 0); they now pass over the mixed
    ones."""
    model = tiny_models.tiny_smollm3()
    config = tiny_config(method, num_layers_to_remove=removed, threshold=None, search_steps=4, **options)
    quantizer = compress(model, config)
    merged = [g for g in quantizer.plan.group_lists() if len(g) > 1]
    assert merged and all(2 not in g and 5 not in g for g in merged)


def test_merging_a_window_of_one_is_identity():
    model = tiny_models.tiny_llama_gqa()
    adapter = get_adapter(model)
    ids = sample_ids()
    before = logits(model, ids)
    block = adapter.build_merged_block("decoder", 2, adapter.mergeable_state(adapter.layers()[2]))
    adapter.replace_block_("decoder", 2, block)
    assert torch.equal(logits(model, ids), before)


def _final_states(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def _naive_cosine(model, candidate_groups, ids, reference):
    states = _final_states(_naive_merged_model(model, candidate_groups), ids).double()
    return torch.nn.functional.cosine_similarity(states, reference.double(), dim=-1).mean().item()


def _context(ids):
    return MethodContext(batches=[CalibrationBatch(ids, torch.ones_like(ids))], progress=False)


def _merge(stack, start, stop):
    return [*stack[:start], tuple(i for g in stack[start : stop + 1] for i in g), *stack[stop + 1 :]]


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen3"])
def test_laco_decisions_match_a_naive_full_forward_loop(factory):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=4)
    cfg = LaCoConfig(window_size=2, interval=1, threshold=0.9, min_layer=1)
    reference = _final_states(model, ids)
    # Naive LaCo: every candidate is a freshly built model run end to end.
    stack, removed, start = [(i,) for i in range(6)], 0, 5 - 2 + 1
    while removed < 2 and start >= 1:
        candidate = _merge(stack, start, start + 1)
        if _naive_cosine(model, candidate, ids, reference) > cfg.threshold:
            stack, removed, start = candidate, removed + 1, start - cfg.interval
        else:
            start -= 1
    plan = LaCoMethod(cfg).plan(get_adapter(model), _context(ids), 2) if removed == 2 else None
    if plan is None:
        with pytest.raises(ValueError, match=r"could not remove 2 layers at threshold=0\.9"):
            LaCoMethod(cfg).plan(get_adapter(model), _context(ids), 2)
    else:
        assert [g.indices for g in plan.groups] == stack


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_sliding_window_decisions_match_a_naive_loop(factory):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=6)
    reference = _final_states(model, ids)
    threshold = 0.8
    stack, removed, end = [(i,) for i in range(6)], 0, 5
    while removed < 2 and end > 1:
        start, best = end - 1, None
        while end - start <= 2 - removed and start >= 1:
            if _naive_cosine(model, _merge(stack, start, end), ids, reference) < threshold:
                break
            best, start = start, start - 1
        if best is not None:
            stack, removed, end = _merge(stack, best, end), removed + end - best, best - 1
        else:
            end -= 1
    method = SlidingWindowMethod(SlidingWindowConfig(threshold=threshold, min_layer=1))
    if removed < 2:
        with pytest.raises(ValueError, match="could not remove"):
            method.plan(get_adapter(model), _context(ids), 2)
        return
    plan = method.plan(get_adapter(model), _context(ids), 2)
    assert [g.indices for g in plan.groups] == stack


def test_sliding_window_threshold_search_reaches_the_target_and_reports_it():
    model = tiny_models.tiny_qwen3()
    original = copy.deepcopy(model)
    quantizer = compress(model, "sliding_window", num_layers_to_remove=3, similarity="cka")
    assert model.config.num_hidden_layers == 3
    assert 0 < quantizer.report["threshold"] <= 1
    assert quantizer.report["final_similarity"] >= quantizer.report["threshold"]
    ids = sample_ids()
    assert not torch.allclose(logits(model, ids), logits(original, ids), atol=1e-3)


def test_reference_code_does_not_commit_the_window_that_reaches_the_bottom():
    """With a threshold every window passes, the published loop grows the first window down to min_layer and
    exits without committing it; the paper's rule commits it."""
    ids = sample_ids(batch=2, length=16)
    plans = {}
    for rule in ("differences", "reference_code"):
        model = tiny_models.tiny_llama_gqa()
        method = SlidingWindowMethod(SlidingWindowConfig(threshold=1e-6, min_layer=3, merge_rule=rule))
        try:
            plans[rule] = [g.indices for g in method.plan(get_adapter(model), _context(ids), 2).groups]
        except ValueError as error:
            plans[rule] = str(error)
    assert plans["differences"] == [(0,), (1,), (2,), (3, 4, 5)]
    assert "could not remove 2 layers" in plans["reference_code"]


@pytest.mark.parametrize(
    ("method", "kwargs", "match"),
    [
        ("laco", dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
        ("sliding_window", dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
        ("laco", dict(min_layer=4), "can remove at most 1"),
        ("sliding_window", dict(min_layer=2, max_layer=3), "can remove at most 1"),
        ("laco", dict(merge_rule="copy"), "merge_rule"),
    ],
)
def test_bad_options_fail_before_any_weight_is_touched(method, kwargs, match):
    model = tiny_models.tiny_llama_gqa()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        compress(model, method, num_layers_to_remove=2, **kwargs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_scoring_batches_equals_calibrating_on_those_batches_only():
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=4, length=16, seed=9)
    batches = [CalibrationBatch(ids[:2], torch.ones_like(ids[:2])), CalibrationBatch(ids[2:], torch.ones_like(ids[2:]))]
    subset = SlidingWindowMethod(SlidingWindowConfig(scoring_batches=1)).plan(
        get_adapter(model), MethodContext(batches=batches, progress=False), 2
    )
    first_only = SlidingWindowMethod(SlidingWindowConfig()).plan(
        get_adapter(model), MethodContext(batches=batches[:1], progress=False), 2
    )
    assert subset == first_only


def test_laco_windows_stay_inside_the_range_after_collapses():
    """Overlapping windows (interval < window_size) must not reach past the top of the shrinking range: every
    accepted collapse removes exactly window_size - 1 layers, and the plan removes exactly the target."""
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=2, length=16)
    cfg = LaCoConfig(window_size=3, interval=1, threshold=1e-6, min_layer=0)
    plan = LaCoMethod(cfg).plan(get_adapter(model), _context(ids), 5)
    assert plan.num_removed == 5 and plan.num_output_layers == 1
    assert [g.indices for g in plan.groups] == [(0, 1, 2, 3, 4, 5)]
    plan = LaCoMethod(cfg).plan(get_adapter(model), _context(ids), 3)
    assert plan.num_removed == 3
    assert [g.indices for g in plan.groups] == [(0,), (1,), (2, 3, 4, 5)]


def test_laco_range_shorter_than_the_window_merges_the_largest_window_that_fits():
    """A protected range [1, 2] cannot hold LaCo's default window of 4: the window shrinks to the range instead of
    the search never starting (which read as "no threshold reaches the target")."""
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=2, length=16)
    cfg = LaCoConfig(window_size=4, interval=2, threshold=1e-6, min_layer=1, max_layer=2)
    plan = LaCoMethod(cfg).plan(get_adapter(model), _context(ids), 1)
    assert [g.indices for g in plan.groups] == [(0,), (1, 2), (3,), (4,), (5,)]


def test_laco_refusal_says_how_close_the_best_window_came_and_never_suggests_a_search():
    """At a threshold no window meets, the refusal gives the closest window's similarity (checked against a naive
    full forward of every candidate) and what to lower; `threshold=None` (which reached the target with a model of
    perplexity 10^6 on SmolLM2) is not offered."""
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=2, length=16, seed=4)
    reference = _final_states(model, ids)
    identity = [(i,) for i in range(6)]
    scores = {start: _naive_cosine(model, _merge(identity, start, start + 1), ids, reference) for start in range(1, 5)}
    threshold = max(scores.values()) + 1e-3  # every window is refused
    with pytest.raises(ValueError) as refusal:
        LaCoMethod(LaCoConfig(window_size=2, interval=1, threshold=threshold, min_layer=1)).plan(
            get_adapter(model), _context(ids), 2
        )
    message = str(refusal.value)
    best_start = max(scores, key=scores.get)
    assert f"could not remove 2 layers at threshold={threshold}" in message
    assert f"merging layers {best_start}-{best_start + 1}" in message
    assert f"{scores[best_start]:.4f}" in message and "it removed 0" in message
    assert "Lower threshold to" in message and "window_size" in message and "num_layers_to_remove" in message
    assert "None" not in message and "search" not in message
    assert "\n" not in message


def test_laco_refusal_after_some_merges_names_the_count_reached():
    """The top window passes and every later one is refused: the refusal says one layer was removed, which merge,
    and the closest refused window (naive full-forward cosines decide which)."""
    model = tiny_models.tiny_llama_gqa()
    ids = sample_ids(batch=2, length=16, seed=4)
    reference = _final_states(model, ids)
    identity = [(i,) for i in range(6)]
    top = _naive_cosine(model, _merge(identity, 4, 5), ids, reference)
    after = [(0,), (1,), (2,), (3,), (4, 5)]
    later = {start: _naive_cosine(model, _merge(after, start, start + 1), ids, reference) for start in (3, 2, 1)}
    threshold = (top + max(later.values())) / 2
    assert top > threshold > max(later.values())  # the premise of this test on this tiny model
    with pytest.raises(ValueError) as refusal:
        LaCoMethod(LaCoConfig(window_size=2, interval=1, threshold=threshold, min_layer=1)).plan(
            get_adapter(model), _context(ids), 2
        )
    message = str(refusal.value)
    best = max(later, key=later.get)
    window = _merge(after, best, best + 1)[best]
    assert "it removed 1 (merged [[4, 5]])" in message
    assert f"merging layers {window[0]}-{window[-1]}" in message and f"{later[best]:.4f}" in message
    assert "num_layers_to_remove to 1 (reached at this threshold)" in message


def _calibration_nll(model, batches):
    """Mean next-token NLL of a full forward over real-token pairs (the naive reference of the report's numbers)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
            valid = (batch.attention_mask[:, :-1] * batch.attention_mask[:, 1:]).bool()
            total += float(
                torch.nn.functional.cross_entropy(logits[valid], batch.input_ids[:, 1:][valid], reduction="sum")
            )
            count += int(valid.sum())
    return total / count


@pytest.mark.parametrize("method", ["laco", "sliding_window"])
def test_searched_threshold_records_the_calibration_loss_of_the_merged_model(method, monkeypatch):
    from optimum_flatten.calibration import build_calibration_batches
    from optimum_flatten.methods.laco import search as stack_search

    model = tiny_models.tiny_llama_gqa()
    original = copy.deepcopy(model)
    kwargs = dict(window_size=2) if method == "laco" else {}
    config = tiny_config(method, num_layers_to_remove=2, threshold=None, **kwargs)
    monkeypatch.setattr(stack_search, "NLL_RISE_BOUND", -1.0)  # any change is "past the bound"
    quantizer = compress(model, config)
    loss = quantizer.report["calibration_loss"]
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    groups = quantizer.plan.group_lists()
    naive = _naive_merged_model(original, [tuple(g) for g in groups])
    assert loss["dense_nll"] == pytest.approx(_calibration_nll(original, batches), rel=1e-4)
    assert loss["merged_nll"] == pytest.approx(_calibration_nll(naive, batches), rel=1e-4)
    assert loss["merged_nll"] == pytest.approx(_calibration_nll(model, batches), rel=1e-4)
    assert loss["rise"] == pytest.approx(loss["merged_nll"] - loss["dense_nll"], abs=2e-6)
    assert quantizer.report["threshold_searched"] is True
    assert "ln 2" in loss["warning"] and "was searched as the highest" in loss["warning"]


def test_no_warning_within_the_bound():
    model = tiny_models.tiny_llama_gqa()
    config = tiny_config("laco", num_layers_to_remove=1, threshold=None, window_size=2)
    quantizer = compress(model, config)
    loss = quantizer.report["calibration_loss"]
    assert loss["bound"] == pytest.approx(0.693147, abs=1e-6)
    assert ("warning" in loss) == (loss["rise"] > loss["bound"])
