"""ffn_merge on Marian: one stack per compression (encoder or decoder), and the paper's "in sync" windows merged at
the same positions in the encoder and the decoder in one compression (``sync_stacks=True``), scored together."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MarianMTModel

import tiny_models
from common import assert_close, compress, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.export.checkpoint import REPORT_NAME
from optimum_flatten.methods.ffn_merge import FfnMergeConfig, FfnMergeMethod, read_mlp, retie_ffn_, write_mlp_
from optimum_flatten.ops.ffn_alignment import permute_mlp_units
from optimum_flatten.utils.torch_utils import count_parameters

#: Stack -> (layers, MLP width) of tiny_marian; d_model is 32.
STACKS = {"encoder": (5, 48), "decoder": (4, 40)}
HIDDEN = 32


def _mlp_numel(stack: str) -> int:
    width = STACKS[stack][1]
    return 2 * HIDDEN * width + width + HIDDEN


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    source, target = sample_ids(2, 10, seed=1), sample_ids(2, 7, seed=2)
    target[:, 0] = model.config.decoder_start_token_id
    return model(input_ids=source, decoder_input_ids=target, use_cache=False).logits


@torch.no_grad()
def _generate(model) -> torch.Tensor:
    return model.generate(input_ids=sample_ids(2, 8, seed=4), max_new_tokens=6, do_sample=False, num_beams=1)


def _batches() -> list[CalibrationBatch]:
    ids = sample_ids(batch=2, length=16, seed=3)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return [CalibrationBatch(ids, mask)]


def _assert_tied(model, stack: str, window: list[int]) -> None:
    adapter = get_adapter(model)
    first = adapter.block(stack, window[0]).mlp
    for i in window[1:]:
        mlp = adapter.block(stack, i).mlp
        for a, b in ((first.up, mlp.up), (first.down, mlp.down)):
            assert a.module.weight.data_ptr() == b.module.weight.data_ptr()
            assert a.module.bias.data_ptr() == b.module.bias.data_ptr()


def _assert_untouched(model, original, stack: str) -> None:
    after, before = get_adapter(model), get_adapter(original)
    for i in range(STACKS[stack][0]):
        assert torch.equal(after.block(stack, i).mlp.up.weight, before.block(stack, i).mlp.up.weight)


def _save_reload_retie(quantizer, model, tmp_path) -> None:
    """Plain MarianMTModel reload: equal logits and generation; retie restores the sharing without changing them."""
    expected, generated = _logits(model), _generate(model)
    path = quantizer.save(model, tmp_path / "out")
    reloaded = MarianMTModel.from_pretrained(path).eval()
    assert type(reloaded) is MarianMTModel
    assert_close(_logits(reloaded), expected)
    assert torch.equal(_generate(reloaded), generated)
    report = json.loads((path / REPORT_NAME).read_text())
    freed = retie_ffn_(reloaded, report)
    assert freed == quantizer.report["ffn_parameters_shared"]
    assert count_parameters(reloaded) == count_parameters(model)
    for group in report["ffn_groups"]:
        _assert_tied(reloaded, group["stack"], group["layers"])
    assert_close(_logits(reloaded), expected)
    get_adapter(reloaded).validate()


# --------------------------------------------------------------------------------------------- one stack
@pytest.mark.parametrize("stack", list(STACKS))
def test_aligning_a_layer_of_either_stack_is_function_preserving(stack):
    """The permutation found for each member (aligned to the window's anchor) leaves the logits unchanged."""
    model = tiny_models.tiny_marian()
    adapter = get_adapter(model)
    reference = _logits(model)
    method = FfnMergeMethod(FfnMergeConfig(window_size=3, window_starts=[0]))
    method.plan(adapter, MethodContext(batches=_batches(), stack=stack, progress=False), 0)
    width = STACKS[stack][1]
    for member in (1, 2):
        permutation = method._scorer.permutation(0, member)
        assert sorted(permutation.tolist()) == list(range(width))
        view = adapter.block(stack, member).mlp
        write_mlp_(view, permute_mlp_units(read_mlp(view), permutation))
        assert_close(_logits(model), reference)


@pytest.mark.parametrize("stack", list(STACKS))
def test_single_stack_merge_ties_saves_and_reloads(stack, tmp_path):
    original, model = tiny_models.tiny_marian(), tiny_models.tiny_marian()
    before = _logits(model)
    quantizer = compress(model, "ffn_merge", stacks=[stack], window_size=2)
    groups = quantizer.report["ffn_groups"]
    assert len(groups) == 1 and groups[0]["stack"] == stack
    window = groups[0]["layers"]
    _assert_tied(model, stack, window)
    assert count_parameters(model) == count_parameters(original) - _mlp_numel(stack)
    assert quantizer.report["ffn_parameters_shared"] == _mlp_numel(stack)
    assert not torch.allclose(_logits(model), before, atol=1e-4)  # the merge is no no-op
    _assert_untouched(model, original, "decoder" if stack == "encoder" else "encoder")
    _save_reload_retie(quantizer, model, tmp_path)


# ----------------------------------------------------------------------------------------------- in sync
def test_sync_merges_the_same_window_in_both_stacks_and_reloads(tmp_path):
    original, model = tiny_models.tiny_marian(), tiny_models.tiny_marian()
    quantizer = compress(model, "ffn_merge", window_size=2, sync_stacks=True)
    groups = quantizer.report["ffn_groups"]
    assert [g["stack"] for g in groups] == ["encoder", "decoder"]
    assert groups[0]["layers"] == groups[1]["layers"]
    for group in groups:
        _assert_tied(model, group["stack"], group["layers"])
    saved = _mlp_numel("encoder") + _mlp_numel("decoder")
    assert count_parameters(model) == count_parameters(original) - saved
    assert quantizer.report["ffn_parameters_shared"] == saved
    by_stack = quantizer.report["ffn_final_scores_by_stack"]
    assert quantizer.report["ffn_final_score"] == pytest.approx((by_stack["encoder"] + by_stack["decoder"]) / 2)
    _save_reload_retie(quantizer, model, tmp_path)


def test_sync_scores_each_position_by_the_mean_of_the_single_stack_scores():
    """Scored together: a position's score is the mean of what one-stack runs score it on each stack (each stack is
    scored with the other unmerged); candidates are the positions that fit both stacks (the decoder has 4 layers)."""
    single = {}
    for stack in STACKS:
        alone = compress(tiny_models.tiny_marian(), "ffn_merge", stacks=[stack], window_size=2)
        rounds = alone.report["ffn_window_scores"]
        single[stack] = {entry["start"]: entry["score"] for entry in rounds[0]}
    quantizer = compress(tiny_models.tiny_marian(), "ffn_merge", window_size=2, sync_stacks=True)
    scored = quantizer.report["ffn_window_scores"][0]
    assert [entry["start"] for entry in scored] == [0, 1, 2]
    for entry in scored:
        mean = (single["encoder"][entry["start"]] + single["decoder"][entry["start"]]) / 2
        assert entry["score"] == pytest.approx(mean, rel=1e-6)
    best = max(scored, key=lambda entry: entry["score"])
    assert quantizer.report["ffn_groups"][0]["layers"] == best["layers"]


def test_sync_with_explicit_windows_merges_both_stacks(tmp_path):
    model = tiny_models.tiny_marian()
    quantizer = compress(model, "ffn_merge", window_size=2, window_starts=[0, 2], sync_stacks=True)
    groups = [(g["stack"], g["layers"]) for g in quantizer.report["ffn_groups"]]
    assert groups == [("encoder", [0, 1]), ("encoder", [2, 3]), ("decoder", [0, 1]), ("decoder", [2, 3])]
    for stack, layers in groups:
        _assert_tied(model, stack, layers)
    _save_reload_retie(quantizer, model, tmp_path)


def test_sync_refusals_change_nothing():
    model = tiny_models.tiny_marian()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"merges every stack \['encoder', 'decoder'\].*got stacks=\['decoder'\]"):
        compress(model, "ffn_merge", stacks=["decoder"], sync_stacks=True)
    with pytest.raises(ValueError, match="sync_stacks=True scores every stack by the cosine"):
        FfnMergeConfig(sync_stacks=True, selection="nll")
    with pytest.raises(ValueError, match="decoder stack: window_size=5 is larger than the stack of 4 layers"):
        compress(model, "ffn_merge", window_size=5, sync_stacks=True)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
