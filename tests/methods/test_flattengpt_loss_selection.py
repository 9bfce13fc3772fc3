"""FlattenGPT's loss selections against naive references, every candidate at every step scored by a plain
transformers model's own loss: for `selection="wide_loss"`, the members of each candidate group run in parallel
(written here from the decoder layers' own submodules); for `selection="loss"`, the model FlattenGPT's one-pass
application gives for the candidate plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiny_models
from common import compress, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.flattengpt import FlattenGPTConfig, FlattenGPTMethod
from optimum_flatten.plan import LayerPlan


class _NaiveParallel(nn.Module):
    """Pre-norm decoder layers run in parallel on one input: every member's attention reads x, every member's MLP
    reads x plus all the attentions' outputs (what concatenating their heads and channels computes)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.attention_type = getattr(members[0], "attention_type", None)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        kwargs.pop("use_cache", None)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        attention = sum(
            m.self_attn(
                hidden_states=m.input_layernorm(hidden_states),
                attention_mask=attention_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **kwargs,
            )[0]
            for m in self.members
        )
        h = hidden_states + attention
        return h + sum(m.mlp(m.post_attention_layernorm(h)) for m in self.members)


def _naive_loss(model, groups: list[tuple[int, ...]], ids: torch.Tensor) -> float:
    reference = copy.deepcopy(model)
    layers = reference.model.layers
    reference.model.layers = nn.ModuleList(
        layers[g[0]] if len(g) == 1 else _NaiveParallel([layers[i] for i in g]) for g in groups
    )
    reference.config.num_hidden_layers = len(groups)
    if isinstance(getattr(reference.config, "layer_types", None), list):
        reference.config.layer_types = [model.config.layer_types[g[0]] for g in groups]
    with torch.no_grad():
        return reference(input_ids=ids, labels=ids, use_cache=False).loss.item()


def _can_merge(groups: list[tuple[int, ...]], merges: int, limit: int, one_kind=lambda group: True) -> bool:
    """Whether `merges` more adjacent merges within `limit` (and of one kind) exist: tried one by one, exhaustively."""
    if merges == 0:
        return True
    return any(
        len(groups[g]) + len(groups[g + 1]) <= limit
        and one_kind(groups[g] + groups[g + 1])
        and _can_merge([*groups[:g], groups[g] + groups[g + 1], *groups[g + 2 :]], merges - 1, limit, one_kind)
        for g in range(len(groups) - 1)
    )


def _one_kind(model):
    """Whether a group's layers share their attention type, read from the config's `layer_types` (all of one kind
    without the list): the rule the planners follow, written from the config alone."""
    types = getattr(model.config, "layer_types", None)
    return lambda group: types is None or len({types[i] for i in group}) == 1


def _naive_greedy(model, ids, merges: int, limit: int, loss=None) -> tuple[list[tuple[int, ...]], list[float]]:
    loss = loss or _naive_loss
    one_kind = _one_kind(model)
    groups: list[tuple[int, ...]] = [(i,) for i in range(model.config.num_hidden_layers)]
    chosen = []
    for step in range(merges):
        scores = {}
        for g in range(len(groups) - 1):
            merged = groups[g] + groups[g + 1]
            after = [*groups[:g], merged, *groups[g + 2 :]]
            if len(merged) <= limit and one_kind(merged) and _can_merge(after, merges - step - 1, limit, one_kind):
                scores[g] = loss(model, after, ids)
        g = min(scores, key=lambda k: (scores[k], k))
        chosen.append(scores[g])
        groups[g : g + 2] = [groups[g] + groups[g + 1]]
    return groups, chosen


@pytest.mark.parametrize(("factory", "limit"), [("llama_gqa", 2), ("qwen2", 3), ("llama_mha", 3)])
def test_wide_loss_selection_matches_naive_parallel_groups(factory, limit):
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=3)
    batches = [CalibrationBatch(ids, torch.ones_like(ids)), CalibrationBatch(ids.flip(0), torch.ones_like(ids))]
    context = MethodContext(batches=batches, progress=False)
    method = FlattenGPTMethod(FlattenGPTConfig(selection="wide_loss", max_group_size=limit, scoring_batches=1))
    plan = method.plan(get_adapter(model), context, 3)
    groups, nlls = _naive_greedy(model, ids, 3, limit)
    assert [g.indices for g in plan.groups] == groups
    recorded = [step["nll"] for step in context.report["selection_steps"]]
    assert recorded == pytest.approx(nlls, abs=2e-5)
    # Planning changes nothing in the model.
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6


@pytest.mark.parametrize(
    ("sizes", "limit", "expected"), [([1] * 6, 2, 3), ([1, 2, 2, 1], 2, 0), ([1, 2, 1, 1, 1], 3, 3), ([1] * 7, 3, 4)]
)
def test_max_merges_against_exhaustive_search(sizes, limit, expected):
    from optimum_flatten.methods.flattengpt.loss_selection import max_merges

    start, groups = 0, []
    for size in sizes:
        groups.append(tuple(range(start, start + size)))
        start += size
    assert max_merges(groups, limit) == expected
    assert _can_merge(groups, expected, limit) and not _can_merge(groups, expected + 1, limit)


def _compressed_loss(batches):
    """The loss of the model FlattenGPT's one-pass application (no selection cache) builds for a candidate plan."""

    def loss(model, groups, ids):
        reference = copy.deepcopy(model)
        adapter = get_adapter(reference)
        plan = LayerPlan(num_layers=len(adapter.layers("decoder")), groups=groups, rule="flatten_prune")
        FlattenGPTMethod(FlattenGPTConfig()).apply_(adapter, plan, MethodContext(batches=batches, progress=False))
        adapter.reindex_("decoder")
        adapter.update_config_("decoder", plan.first_indices)
        with torch.no_grad():
            return reference(input_ids=ids, labels=ids, use_cache=False).loss.item()

    return loss


@pytest.mark.parametrize(("factory", "limit"), [("llama_gqa", 2), ("qwen2", 3)])
def test_loss_selection_matches_naive_compressed_candidates(factory, limit):
    """Each candidate scored as the compressed model itself, and the result is the application's model for the
    chosen plan (the prebuilt blocks equal a fresh one-pass compression)."""
    model = tiny_models.FACTORIES[factory]()
    ids = sample_ids(batch=2, length=16, seed=3)
    batches = [CalibrationBatch(ids, torch.ones_like(ids)), CalibrationBatch(ids.flip(0), torch.ones_like(ids))]
    groups, nlls = _naive_greedy(model, ids, 2, limit, loss=_compressed_loss(batches))
    context = MethodContext(batches=batches, progress=False)
    method = FlattenGPTMethod(FlattenGPTConfig(selection="loss", max_group_size=limit, scoring_batches=1))
    compressed = copy.deepcopy(model)
    adapter = get_adapter(compressed)
    plan = method.plan(adapter, context, 2)
    assert [g.indices for g in plan.groups] == groups
    assert [step["nll"] for step in context.report["selection_steps"]] == pytest.approx(nlls, abs=2e-5)
    method.apply_(adapter, plan, context)
    assert len(context.report["groups"]) == sum(1 for g in groups if len(g) > 1)
    reference = copy.deepcopy(model)
    ref_adapter = get_adapter(reference)
    FlattenGPTMethod(FlattenGPTConfig()).apply_(ref_adapter, plan, MethodContext(batches=batches, progress=False))
    for (name, a), (_, b) in zip(compressed.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def test_loss_selection_compresses_to_a_stock_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from optimum_flatten.export.model_card import render_model_card

    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2, selection="loss")
    assert model.config.num_hidden_layers == 4
    steps = quantizer.report["selection_steps"]
    card = render_model_card(quantizer.report)
    for k, step in enumerate(steps):
        assert f"Merge {k + 1} chosen by calibration loss: {step['merged']}" in card
        assert f"runner-up {step['runner_up']['merged']}" in card
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(selection="similarity_loss"), "selection must be 'similarity', 'loss' or 'wide_loss'"),
        (dict(selection="loss", calibration_mode="sequential"), "original model's states"),
        (dict(selection="loss", max_group_size=None), "give max_group_size"),
        (dict(selection="loss", scoring_batches=0), "scoring_batches must be a positive integer"),
    ],
)
def test_bad_selection_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlattenGPTConfig(**kwargs)


def test_loss_selection_refuses_an_impossible_target_before_any_change():
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="4 merges cannot be made within max_group_size=2"):
        compress(model, "flattengpt", num_layers_to_remove=4, selection="loss", max_group_size=2)
    assert model.config.num_hidden_layers == 6
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("pattern", [[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
def test_loss_selection_merges_only_layers_of_one_kind(pattern):
    """SmolLM3 with its config's NoPE layers laid out so that the lowest-loss pair mixes kinds: that pair was planned
    and the whole run refused (LayerKindMergeError); a merge across kinds is now no candidate, whatever its loss.
    (Only the config is read for the kinds, so setting its list is enough for the plan.)"""
    model = tiny_models.tiny_smollm3()
    model.config.no_rope_layers = list(pattern)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2, selection="loss")
    merged = [g for g in quantizer.plan.group_lists() if len(g) > 1]
    assert merged and all(len({pattern[i] for i in g}) == 1 for g in merged)


@pytest.mark.parametrize("pattern", [[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
def test_the_similarity_selection_merges_only_layers_of_one_kind(pattern):
    """FlattenGPT's default selection (the most similar adjacent pair) had the same blind spot as the loss selection:
    on these NoPE layouts its pair mixed kinds and the run was refused."""
    model = tiny_models.tiny_smollm3()
    model.config.no_rope_layers = list(pattern)
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2)
    merged = [g for g in quantizer.plan.group_lists() if len(g) > 1]
    assert merged and all(len({pattern[i] for i in g}) == 1 for g in merged)
