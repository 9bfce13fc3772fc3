"""UIDL, ReplaceMe and linear_replacement against naive full-forward references on tiny models."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import tiny_models
from common import (
    compress,
    decoder_layers,
    logits,
    mlp_parts,
    naive_least_squares_map,
    sample_ids,
    shallower_reference,
    tiny_config,
)
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.methods.uidl import block_distances
from optimum_flatten.utils.errors import UnsupportedArchitectureError


def _config(method: str, n: int = 2, **options) -> FlattenConfig:
    return tiny_config(method, num_layers_to_remove=n, **options)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "gpt2"])
def test_replaceme_folds_the_least_squares_map_of_the_naive_reference(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    config = _config("replaceme", n=2, tokens="all")
    quantizer = compress(model, config)
    ((start, end),) = quantizer.report["blocks"]
    assert start >= 1 and end == start + 2
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    transform = naive_least_squares_map(original, batches, start - 1, end)

    _, _, down_before = mlp_parts(decoder_layers(original)[start - 1])
    _, _, down_after = mlp_parts(decoder_layers(model)[start - 1])
    expected = transform.T @ down_before().double()
    torch.testing.assert_close(down_after().double(), expected, atol=2e-5, rtol=1e-4)

    # The fold is exact: the compressed model equals the dense model without the block, with T applied to the MLP
    # output of the layer before it by a hook (the naive, unfolded form).
    kept = [i for i in range(len(decoder_layers(original))) if not start <= i < end]
    reference = shallower_reference(original, kept) if factory != "gpt2" else None
    if reference is not None:
        mlp, _, _ = mlp_parts(decoder_layers(reference)[start - 1])
        mlp.register_forward_hook(lambda _m, _a, out: out @ transform.float())
        ids = sample_ids(batch=2, length=16, seed=5)
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-4, rtol=1e-4)
    assert quantizer.report["replaceme"]["maps"][0]["span"] == [start - 1, end]


def test_uidl_distances_match_the_naive_last_token_angle_with_padding():
    model = tiny_models.FACTORIES["llama_gqa"]()
    ids = sample_ids(batch=3, length=14, seed=4)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: row 1's last real token is position 8
    context = MethodContext(batches=[CalibrationBatch(ids, mask)], progress=False)
    states = context.new_states(get_adapter(model), keep=())
    distances = block_distances(states, size=2, tokens="last")

    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    last = [13, 8, 13]
    for start in range(0, 6 - 2):  # boundary 6 is after the final norm in hidden_states: compare the others
        angles = []
        for row, pos in enumerate(last):
            a, b = hidden[start][row, pos].double(), hidden[start + 2][row, pos].double()
            angles.append(math.acos(max(-1.0, min(1.0, float(a @ b / (a.norm() * b.norm()))))) / math.pi)
        assert distances[start] == pytest.approx(sum(angles) / 3, abs=1e-9)
    assert set(distances) == set(range(5))


@pytest.mark.parametrize("size", [1, 3])
def test_block_distances_from_last_token_rows_equal_those_of_whole_boundaries(size):
    """The walk keeps each boundary's last-token rows only; every distance is the same float as `mean_angle` on the
    whole boundaries, with left and right padding and several batches."""
    model = tiny_models.FACTORIES["llama_gqa"]()
    batches = []
    for seed in (4, 5):
        ids = sample_ids(batch=3, length=14, seed=seed)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0  # right padding
        mask[2, :4] = 0  # left padding
        batches.append(CalibrationBatch(ids, mask))
    context = MethodContext(batches=batches, progress=False)
    states = context.new_states(get_adapter(model), keep=None)
    distances = block_distances(states, size=size, tokens="last")
    boundaries = [states.boundary(i) for i in range(states.num_layers + 1)]
    expected = {
        start: states.mean_angular_distance(boundaries[start], boundaries[start + size], tokens="last")
        for start in range(states.num_layers - size + 1)
    }
    assert distances == expected


def test_uidl_drops_the_block_with_the_smallest_distance_and_equals_the_shallower_model():
    model = tiny_models.FACTORIES["qwen3"]()
    original = copy.deepcopy(model)
    quantizer = compress(model, _config("uidl", n=2))
    distances = {int(k): v for k, v in quantizer.report["block_distances"].items()}
    best = min(distances, key=lambda s: (distances[s], s))
    assert quantizer.report["blocks"] == [[best, best + 2]]
    kept = [i for i in range(6) if not best <= i < best + 2]
    ids = sample_ids(batch=2, length=16, seed=6)
    torch.testing.assert_close(logits(model, ids), logits(shallower_reference(original, kept), ids))


def test_two_blocks_do_not_overlap_and_each_gets_a_map():
    model = tiny_models.FACTORIES["llama_mha"]()
    quantizer = compress(model, _config("replaceme", n=2, num_blocks=2))
    (a0, a1), (b0, b1) = quantizer.report["blocks"]
    assert a1 <= b0 and a1 - a0 == 1 and b1 - b0 == 1
    assert [m["span"] for m in quantizer.report["replaceme"]["maps"]] == [[a0 - 1, a1], [b0 - 1, b1]] or (
        a1 == b0 and len(quantizer.report["replaceme"]["maps"]) == 1
    )
    assert model.config.num_hidden_layers == 4


def test_cosine_estimator_records_its_steps_and_lowers_the_distance():
    model = tiny_models.FACTORIES["llama_gqa"]()
    quantizer = compress(model, _config("replaceme", n=2, estimator="cosine", cosine_epochs=3, cosine_lr=1e-3))
    (entry,) = quantizer.report["replaceme"]["maps"]
    tokens = entry["tokens"]
    assert entry["optimizer_steps"] == 3 * math.ceil(tokens / 1024)
    assert entry["cosine_distance_after"] < entry["cosine_distance_before"]


@pytest.mark.parametrize("method", ["shortgpt", "flattengpt"])
def test_linear_replacement_bridges_every_span_and_reloads_with_plain_transformers(method, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["llama_gqa"]()
    reference = copy.deepcopy(model)
    quantizer = compress(model, _config(method, n=2, linear_replacement="lstsq"))
    spans = [m["span"] for m in quantizer.report["linear_replacement"]["maps"]]
    plan = quantizer.plan
    expected = []
    for k, group in enumerate(plan.groups):
        end = plan.groups[k + 1].indices[0] if k + 1 < len(plan.groups) else plan.num_layers
        if end - group.indices[0] > 1:
            expected.append([group.indices[0], end])
    assert spans == expected and spans
    compress(reference, _config(method, n=2))  # the same plan without the maps differs
    ids = sample_ids(batch=2, length=16, seed=7)
    assert not torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-4)

    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


@pytest.mark.parametrize("factory", ["qwen3", "gpt2"])  # ShortGPT drops layers 3 and 5 there, not a leading one
def test_linear_replacement_drop_plan_matches_the_naive_fit(factory):
    model = tiny_models.FACTORIES[factory]()
    original = copy.deepcopy(model)
    config = _config("shortgpt", n=1, linear_replacement="lstsq")
    quantizer = compress(model, config)
    (dropped,) = quantizer.plan.dropped_indices
    assert dropped > 0
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    transform = naive_least_squares_map(original, batches, dropped - 1, dropped + 1)
    assert quantizer.report["linear_replacement"]["maps"][0]["span"] == [dropped - 1, dropped + 1]
    _, _, before = mlp_parts(decoder_layers(original)[dropped - 1])
    _, _, after = mlp_parts(decoder_layers(model)[dropped - 1])
    torch.testing.assert_close(after().double(), transform.T @ before().double(), atol=2e-5, rtol=1e-4)


def test_bad_requests_are_refused_before_any_weight_changes():
    with pytest.raises(ValueError, match=r"unknown linear-replacement estimator .lsq.*lstsq"):
        _config("replaceme", estimator="lsq")
    with pytest.raises(ValueError, match="unknown linear_replacement 'cos'"):
        _config("shortgpt", linear_replacement="cos")
    with pytest.raises(ValueError, match="fits its own linear replacement"):
        _config("replaceme", linear_replacement="lstsq")
    with pytest.raises(ValueError, match="keeps every layer"):
        FlattenConfig(method="ffn_merge", dataset=["x"], linear_replacement="lstsq")

    model = tiny_models.FACTORIES["llama_gqa"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(Exception, match=r"cannot remove 6|at most 5"):
        compress(model, _config("replaceme", n=6))
    with pytest.raises(Exception, match="cannot be split into 3 equal blocks"):
        compress(model, _config("replaceme", n=4, num_blocks=3))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0)

    bert = tiny_models.FACTORIES["bert"]()
    bert_before = {k: v.clone() for k, v in bert.state_dict().items()}
    for config in (_config("replaceme"), _config("shortgpt", linear_replacement="lstsq")):
        with pytest.raises(UnsupportedArchitectureError, match="pre-norm"):
            compress(bert, config)
    for key, value in bert.state_dict().items():
        torch.testing.assert_close(value, bert_before[key], atol=0, rtol=0)


def test_a_leading_dropped_run_is_reported_unbridged():
    model = tiny_models.FACTORIES["llama_gqa"]()  # ShortGPT drops layer 0 here
    quantizer = compress(model, _config("shortgpt", n=1, linear_replacement="lstsq"))
    assert quantizer.plan.dropped_indices == [0]
    assert quantizer.report["linear_replacement"]["maps"] == []
    assert quantizer.report["linear_replacement"]["unbridged_leading_layers"] == [0]


@torch.no_grad()
def _naive_nll(model, batch) -> float:
    """Mean next-token NLL over pairs of real tokens, from one full forward (float64 log-softmax)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
    logp = torch.log_softmax(out[:, :-1], dim=-1)
    nll = -logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    pairs = batch.attention_mask[:, :-1].bool() & batch.attention_mask[:, 1:].bool()
    return float(nll[pairs].mean())


def test_loss_selection_scores_every_block_as_the_naive_replaced_model_and_takes_the_lowest():
    model = tiny_models.FACTORIES["llama_gqa"]()
    original = copy.deepcopy(model)
    config = _config("replaceme", n=2, tokens="all", selection="loss", scoring_batches=1, batch_size=4)
    quantizer = compress(model, config)
    losses = {int(s): v for s, v in quantizer.report["block_losses"].items()}
    assert sorted(losses) == [1, 2, 3, 4]  # every start with a layer before it, for 6 layers and n=2
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    assert len(batches) == 2
    for start, score in losses.items():
        transform = naive_least_squares_map(original, batches, start - 1, start + 2)  # fitted on every batch
        kept = [i for i in range(6) if not start <= i < start + 2]
        reference = shallower_reference(original, kept)
        mlp, _, _ = mlp_parts(decoder_layers(reference)[start - 1])
        mlp.register_forward_hook(lambda _m, _a, out, t=transform: out @ t.float())
        assert score == pytest.approx(_naive_nll(reference, batches[0]), abs=2e-5)  # scored on the first batch
    best = min(losses, key=losses.get)
    assert quantizer.report["blocks"] == [[best, best + 2]]
    assert len(decoder_layers(model)) == 4


def test_loss_selection_refusals():
    with pytest.raises(ValueError, match="selection='loss' chooses one block"):
        _config("replaceme", n=2, selection="loss", num_blocks=2)
    with pytest.raises(ValueError, match="selection must be"):
        _config("replaceme", n=2, selection="angle")
    with pytest.raises(UnsupportedArchitectureError, match="no LM head"):
        compress(tiny_models.FACTORIES["vit"](), _config("replaceme", n=2, selection="loss"))
