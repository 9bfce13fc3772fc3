"""greedy_replace's shortlist: a pre-ranking that bounds the suffix runs, equal to the exhaustive search when wide."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer


def _run(model, **options) -> FlattenQuantizer:
    return compress(model, "greedy_replace", num_layers_to_remove=2, batch_size=4, **options)


def test_a_shortlist_as_wide_as_every_action_is_the_exhaustive_search():
    model = tiny_models.FACTORIES["llama_gqa"]()
    wide_model = copy.deepcopy(model)
    exhaustive = _run(model)
    wide = _run(wide_model, shortlist=11)  # 6 drops + 5 replacements on 6 layers
    strip = [{k: v for k, v in step.items() if k != "shortlist"} for step in wide.report["greedy_replace_steps"]]
    assert strip == exhaustive.report["greedy_replace_steps"]
    assert len(wide.report["greedy_replace_steps"][0]["shortlist"]) == 11
    ids = sample_ids(batch=2, length=16, seed=4)
    torch.testing.assert_close(logits(wide_model, ids), logits(model, ids))


def test_a_narrow_shortlist_scores_fewer_actions_and_takes_one_of_them():
    model = tiny_models.FACTORIES["qwen3"]()
    exhaustive = _run(copy.deepcopy(model))
    narrow = _run(model, shortlist=2)
    for step in narrow.report["greedy_replace_steps"]:
        assert len(step["shortlist"]) == 2
        assert f"{step['action']} {step['layer']}" in step["shortlist"]
    assert narrow.report["cost"]["stack_passes"] < exhaustive.report["cost"]["stack_passes"]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (0, "shortlist must be a positive integer or None"),
        (-1, "shortlist must be a positive integer or None"),
        (True, "shortlist must be an integer or None, got True"),  # refused by the type check, before the range
        (2.5, "shortlist must be an integer or None, got 2.5"),
    ],
)
def test_bad_shortlist_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        FlattenConfig(method="greedy_replace", num_layers_to_remove=1, dataset=["x"], shortlist=bad)
