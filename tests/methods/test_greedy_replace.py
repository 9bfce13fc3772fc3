"""greedy_replace: each step's choice against naive full-model evaluations of every action on copies."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, naive_least_squares_map, shallower_reference, tiny_config
from optimum_flatten import FlattenConfig
from optimum_flatten.calibration.data import build_calibration_batches


def _config(n: int, **options) -> FlattenConfig:
    return tiny_config("greedy_replace", num_layers_to_remove=n, batch_size=4, **options)


@torch.no_grad()
def _nll(model, batches) -> float:
    total, count = 0.0, 0
    for batch in batches:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
        valid = (batch.attention_mask[:, :-1] & batch.attention_mask[:, 1:]).bool()
        total += float(torch.nn.functional.cross_entropy(logits[valid], batch.input_ids[:, 1:][valid], reduction="sum"))
        count += int(valid.sum())
    return total / count


@torch.no_grad()
def _naive_replace(model, batches, previous: int, removed: int):
    """The shallower model with the least-squares map (torch.linalg.lstsq on all real tokens) folded at `previous`."""
    transform = naive_least_squares_map(model, batches, previous, removed + 1)
    kept = [i for i in range(model.config.num_hidden_layers) if i != removed]
    reference = shallower_reference(model, kept)
    down = reference.model.layers[previous].mlp.down_proj
    down.weight.copy_((transform.T @ down.weight.double()).float())
    return reference


def test_first_step_takes_the_action_with_the_lowest_naive_loss_and_the_result_scores_what_the_search_said():
    model = tiny_models.FACTORIES["llama_gqa"]()
    original = copy.deepcopy(model)
    config = _config(1, scoring_batches=None)
    quantizer = compress(model, config)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    (step,) = quantizer.report["greedy_replace_steps"]

    naive = {}
    for layer in range(6):  # layer 5's output is not a hidden state before the final norm: covered by the others
        kept = [i for i in range(6) if i != layer]
        naive[("drop", layer)] = _nll(shallower_reference(original, kept), batches)
        if 0 < layer < 5:
            naive[("replace", layer)] = _nll(_naive_replace(original, batches, layer - 1, layer), batches)
    best = min(naive, key=naive.get)
    if (step["action"], step["layer"]) in naive:
        assert naive[(step["action"], step["layer"])] == pytest.approx(naive[best], rel=1e-4)
    assert step["nll"] <= naive[best] * (1 + 1e-4)
    assert _nll(model, batches) == pytest.approx(step["nll"], rel=1e-4)


def test_several_steps_fold_the_maps_they_chose_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["qwen2"]()
    config = _config(2)
    quantizer = compress(model, config)
    steps = quantizer.report["greedy_replace_steps"]
    assert len(steps) == 2 and model.config.num_hidden_layers == 4
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)[:1]
    assert _nll(model, batches) == pytest.approx(steps[-1]["nll"], rel=1e-4)
    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert _nll(reloaded, batches) == pytest.approx(steps[-1]["nll"], rel=1e-5)


def test_post_norm_and_bad_options_are_refused():
    from optimum_flatten.utils.errors import UnsupportedArchitectureError

    with pytest.raises(ValueError, match="scoring_batches"):
        _config(1, scoring_batches=0)
    bert = tiny_models.FACTORIES["bert"]()
    with pytest.raises(UnsupportedArchitectureError, match="pre-norm"):
        compress(bert, _config(1))


# ------------------------------------------------------------------------------------------ the flatten action
@torch.no_grad()
def _naive_flatten(model, config: FlattenConfig, first: int):
    """The model with the pair (first, first + 1) merged by FlattenGPT itself (its own plan and application on a
    copy: full forwards, none of the search's cached states)."""
    from optimum_flatten import get_adapter
    from optimum_flatten.compression.method import MethodContext
    from optimum_flatten.methods.flattengpt import FlattenGPTMethod
    from optimum_flatten.plan import LayerPlan

    reference = copy.deepcopy(model)
    adapter = get_adapter(reference)
    num_layers = reference.config.num_hidden_layers
    groups = [[first, first + 1] if i == first else [i] for i in range(num_layers) if i != first + 1]
    plan = LayerPlan(num_layers=num_layers, groups=groups, rule="flatten_prune")
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    context = MethodContext(batches=batches, stack="decoder", progress=False)
    FlattenGPTMethod(config.method_config.flatten_config()).apply_(adapter, plan, context)
    adapter.reindex_("decoder")
    adapter.update_config_("decoder", plan.first_indices)
    return reference


@pytest.mark.parametrize("paper_merge", [True, False])
def test_flatten_action_scores_what_a_full_forward_of_flattengpts_own_merge_scores(monkeypatch, paper_merge):
    """With drops taken out of the actions (layer 0's too, which `allow_drop=False` keeps because no map can replace
    it; on this tiny model it would win), the first step's choice is the action whose result, built on a copy by
    FlattenGPT itself (merges) or with torch.linalg.lstsq (maps) and scored by full forwards, has the lowest loss,
    and the compressed model scores what the search said. With the paper's head target and selection
    (`flatten_options`) that action is a merge; with FlattenGPT's defaults, on this tiny random model, a map."""
    from optimum_flatten.methods.greedy_replace import GreedyReplaceMethod

    actions = GreedyReplaceMethod._actions

    def without_drops(self, *args, **kwargs):
        return (a for a in actions(self, *args, **kwargs) if a[0] != "drop")

    monkeypatch.setattr(GreedyReplaceMethod, "_actions", without_drops)
    model = tiny_models.FACTORIES["llama_gqa"]()
    original = copy.deepcopy(model)
    paper = {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"}
    options = paper if paper_merge else {}
    config = _config(1, scoring_batches=None, allow_flatten=True, allow_drop=False, flatten_options=options)
    quantizer = compress(model, config)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    (step,) = quantizer.report["greedy_replace_steps"]
    naive = {("flatten", first + 1): _nll(_naive_flatten(original, config, first), batches) for first in range(5)}
    for layer in range(1, 6):
        naive[("replace", layer)] = _nll(_naive_replace(original, batches, layer - 1, layer), batches)
    best = min(naive, key=naive.get)
    assert best[0] == ("flatten" if paper_merge else "replace")  # not vacuous: with the paper's pair a merge wins
    assert (step["action"], step["layer"]) == best
    assert step["nll"] == pytest.approx(naive[best], rel=1e-4)
    assert _nll(model, batches) == pytest.approx(step["nll"], rel=1e-4)
    if paper_merge:
        assert step["merged_with"] == best[1] - 1
        assert quantizer.report["greedy_replace_merges"] == [[best[1] - 1, best[1]]]
        assert quantizer.plan.merged_groups == [(best[1] - 1, best[1])] and quantizer.plan.rule == "flatten_prune"


def test_merges_drops_and_maps_together_reload_as_the_search_scored(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["qwen2"]()
    config = _config(3, scoring_batches=None, allow_flatten=True)
    quantizer = compress(model, config)
    steps = quantizer.report["greedy_replace_steps"]
    assert model.config.num_hidden_layers == 3 and len(steps) == 3
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    assert _nll(model, batches) == pytest.approx(steps[-1]["nll"], rel=1e-4)
    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert _nll(reloaded, batches) == pytest.approx(steps[-1]["nll"], rel=1e-5)


def test_flatten_is_refused_where_flattengpt_is_and_the_option_must_be_a_bool():
    from optimum_flatten.utils.errors import UnsupportedArchitectureError

    with pytest.raises(TypeError, match="allow_flatten"):
        _config(1, allow_flatten="yes")
    qwen3 = tiny_models.FACTORIES["qwen3"]()  # per-head q/k norms: heads cannot be concatenated across layers
    before = copy.deepcopy(qwen3.state_dict())
    compress(copy.deepcopy(qwen3), _config(1))  # drops and maps alone are fine there
    with pytest.raises(UnsupportedArchitectureError, match="'flattengpt' needs"):
        compress(qwen3, _config(1, allow_flatten=True))
    assert all(torch.equal(before[k], v) for k, v in qwen3.state_dict().items())


@pytest.mark.parametrize(
    ("options", "message"),
    [({"attention_targt": "parallel"}, "no FlattenGPT option"), ({"attention_target": "serial"}, "attention_target")],
)
def test_flatten_options_are_checked_before_any_weight_changes(options, message):
    model = tiny_models.FACTORIES["llama_gqa"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        compress(model, _config(1, allow_flatten=True, flatten_options=options))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
