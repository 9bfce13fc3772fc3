"""ffn_merge: honest parameter counts (file vs memory) in the report, card and CLI summary, and the cheaper
search computing exactly what the pair-by-pair, whole-batch version computed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import tiny_models
from common import compress, sample_ids
from optimum_flatten import get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.cli.main import compression_summary
from optimum_flatten.compression.method import MethodContext
from optimum_flatten.export.model_card import describe_parameters
from optimum_flatten.methods.ffn_merge import FfnMergeConfig, FfnMergeMethod, WindowScorer, read_mlp, retie_ffn_
from optimum_flatten.ops.ffn_alignment import (
    alignment_signals,
    correlation_from_sums,
    correlation_sums,
    num_alignment_signals,
)
from optimum_flatten.utils.torch_utils import count_parameters


def _file_footprint(path) -> tuple[int, int]:
    elements = size = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            elements, size = elements + tensor.numel(), size + tensor.numel() * tensor.element_size()
    return elements, size


# ------------------------------------------------------------------------------------- honest parameter counts
def test_report_card_and_summary_give_the_file_count_and_the_in_memory_count_apart(tmp_path):
    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "ffn_merge", window_size=2, num_windows=2)
    report = quantizer.report
    path = quantizer.save(model, tmp_path / "out")

    in_file, in_memory = report["ffn_parameters_in_file"], report["ffn_parameters_in_memory"]
    # The file stores every layer's MLP in full: as many parameters as the base model, and as a plain reload has.
    assert (in_file, report["ffn_bytes_in_file"]) == _file_footprint(path)
    assert in_file == report["parameters_before"]
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert count_parameters(reloaded) == in_file
    # The smaller number is what retie_ffn_ leaves in memory, and only that.
    assert in_memory == report["parameters_after"] == in_file - report["ffn_parameters_shared"] < in_file
    assert report["ffn_bytes_in_memory"] == 4 * in_memory
    retie_ffn_(reloaded, json.loads((path / "flatten_report.json").read_text()))
    assert count_parameters(reloaded) == in_memory

    card = (path / "README.md").read_text()
    line = next(line for line in card.splitlines() if line.startswith("- Parameters:"))
    assert f"-> {in_file:,} in the checkpoint" in line
    assert f"{in_memory:,} in memory after retie_ffn_" in line
    assert f"-> {in_memory:,}" not in card  # never presented as what the compression produced on disk
    assert "stored in full" in card and "as large as the base model" in card
    summary = compression_summary(report)
    assert f"{in_file:,} in the checkpoint" in summary and f"{in_memory:,} in memory after retie_ffn_" in summary


def test_untied_merge_claims_no_saving():
    model = tiny_models.tiny_llama_gqa()
    report = compress(model, "ffn_merge", window_size=2, window_starts=[1], tie=False).report
    assert report["ffn_parameters_in_file"] == report["ffn_parameters_in_memory"] == report["parameters_before"]
    text = describe_parameters(report)
    assert "retie_ffn_" not in text and f"{report['parameters_before']:,} in the checkpoint" in text


def test_reports_of_earlier_versions_fall_back_to_the_count_before():
    report = {"parameters_before": 1000, "parameters_after": 800, "ffn_groups": [{"layers": [1, 2]}]}
    assert describe_parameters(report) == (
        "1,000 -> 1,000 in the checkpoint (model.safetensors, and a plain from_pretrained); "
        "800 in memory after retie_ffn_"
    )
    assert describe_parameters({"parameters_before": 10, "parameters_after": 8}) == "10 -> 8"


# --------------------------------------------------------------------------------- the search, computed exactly
def _batches() -> list[CalibrationBatch]:
    batches = []
    for seed in (3, 4):
        ids = sample_ids(batch=2, length=16, seed=seed)
        mask = torch.ones_like(ids)
        mask[1, -4:] = 0
        batches.append(CalibrationBatch(ids, mask))
    return batches


def _pairwise_correlation(scorer: WindowScorer, anchor: int, member: int) -> torch.Tensor:
    """The earlier computation: one pair, one signal at a time, both layers' signals recomputed per signal."""
    views = [scorer.adapter.block(scorer.stack, i).mlp for i in (anchor, member)]
    weights = [read_mlp(v) for v in views]
    signal = scorer.config.alignment_signal
    total = None
    for s in range(num_alignment_signals(weights[0], signal)):
        sums = None
        for b in range(len(scorer.masks)):
            a, m = (
                alignment_signals(scorer._tokens(i, b), w, signal, v.activation)[s]
                for i, w, v in zip((anchor, member), weights, views, strict=True)
            )
            batch = correlation_sums(a, m)
            sums = batch if sums is None else sums + batch
        corr = correlation_from_sums(sums)
        total = corr if total is None else total + corr
    return total / num_alignment_signals(weights[0], signal)


@pytest.mark.parametrize(("factory", "signal"), [("llama_gqa", "pre_activation"), ("gpt2", "hidden")])
def test_one_pass_alignment_equals_the_pairwise_one_bit_for_bit(factory, signal):
    model = tiny_models.FACTORIES[factory]()
    config = FfnMergeConfig(window_size=3, alignment_signal=signal)
    scorer = WindowScorer(get_adapter(model), MethodContext(batches=_batches(), progress=False), config)
    together = scorer.correlations(1, [2, 3])
    for member in (2, 3):
        assert torch.equal(together[member], _pairwise_correlation(scorer, 1, member))


@torch.no_grad()
def _whole_batch_nll(scorer: WindowScorer, final: list[torch.Tensor]) -> float:
    """The earlier NLL: float64 logits of whole batches, (batch, seq, vocab) at once."""
    head = scorer.adapter.lm_head(scorer.stack)
    total, count = 0.0, 0
    for h, batch, mask in zip(scorer.finish(final), scorer.batches, scorer.masks, strict=True):
        logits = head(h[:, :-1]).double()
        valid = (mask[:, :-1] * mask[:, 1:]).bool()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
        total, count = total + float(losses[valid].sum()), count + int(valid.sum())
    return total / count


def test_row_bounded_nll_equals_the_whole_batch_one():
    model = tiny_models.tiny_qwen2()
    config = FfnMergeConfig(window_size=2, selection="nll")
    context = MethodContext(batches=_batches(), progress=False)
    scorer = WindowScorer(get_adapter(model), context, config)
    final = scorer.states[-1]
    # float64 throughout: only the order of the summation differs, a few units in the last place.
    assert scorer.score(final) == pytest.approx(_whole_batch_nll(scorer, final), rel=1e-13)
    assert context.extra_work > 0  # the LM head's work is counted in the cost, as SLEB counts it


@torch.no_grad()
@pytest.mark.parametrize("selection", ["cosine", "nll"])
def test_final_score_is_what_a_fresh_run_with_every_window_gives(selection):
    """The last round's winner is not run a second time: its score is the final score, bit for bit."""
    model = tiny_models.tiny_llama_gqa()
    adapter = get_adapter(model)
    method = FfnMergeMethod(FfnMergeConfig(window_size=2, num_windows=2, selection=selection))
    context = MethodContext(batches=_batches(), progress=False)
    method.plan(adapter, context, 0)
    scorer, windows = method._scorer, method._windows
    blocks = method._candidate_blocks(adapter, "decoder", windows, scorer)
    fresh = scorer.score(scorer.run_from(windows[0][0], blocks, scorer.states))
    assert context.report["ffn_final_score"] == fresh
    pick = max if selection == "cosine" else min
    assert pick(c["score"] for c in context.report["ffn_window_scores"][-1]) == fresh
