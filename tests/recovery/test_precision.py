"""Healing in the weights' own precision: float16 weights trained in place are refused before any change (their
gradients overflow without loss scaling: no weight moved, the gate kept the input), bfloat16 ones are warned about
with the rate and the rounding that swallow the steps, and LoRA is left alone (`recover --dtype`:
tests/cli/test_recover_review_doors.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tiny_models
from common import compress, tiny_config, tiny_recovery_config
from optimum_flatten import FlattenQuantizer
from optimum_flatten.recovery import recover


@pytest.fixture(scope="module")
def compressed():
    dense = tiny_models.tiny_llama_gqa()
    model = copy.deepcopy(dense)
    report = compress(model, "shortgpt", num_layers_to_remove=2).report
    return dense, model, report


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["full", "local"])
def test_float16_weights_trained_in_place_are_refused_before_any_change(compressed, mode):
    dense, model, report = compressed
    student, teacher = copy.deepcopy(model).half(), copy.deepcopy(dense).half()
    before = _state(student)
    with pytest.raises(ValueError, match=rf"^mode '{mode}' trains the model's float16 weights in place"):
        recover(student, tiny_models.CharTokenizer(), tiny_models.sample_texts(), tiny_recovery_config(mode=mode),
                teacher=teacher, report=report)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_float16_healing_in_compress_is_refused_before_the_compression():
    model = tiny_models.tiny_llama_gqa().half()
    heal = {"mode": "full", "max_tokens": 256, "seqlen": 16, "heldout_rows": 0}
    config = tiny_config("shortgpt", num_layers_to_remove=2, heal=heal)
    with pytest.raises(ValueError, match=r"float16 weights in place, whose gradients overflow"):
        FlattenQuantizer(config, progress=False).compress(model, tiny_models.CharTokenizer())
    assert len(model.model.layers) == 6


@pytest.mark.parametrize(("mode", "warned"), [("full", True), ("lora", False)])
def test_bfloat16_steps_below_the_rounding_are_warned_about(compressed, mode, warned):
    """At the default rate (about 3e-4 of the weights' scale) a step is below bfloat16's half rounding step (2^-9 of
    the weight) for most weights; LoRA's adapters train in float32 and are not warned about."""
    dense, model, report = compressed
    student, teacher = copy.deepcopy(model).bfloat16(), copy.deepcopy(dense).bfloat16()
    config = tiny_recovery_config(mode=mode, max_tokens=64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, log = recover(student, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=teacher,
                         report=report)  # fmt: skip
    assert any("trains bfloat16 weights in place" in str(w.message) for w in seen) == warned
    assert any("most steps will be lost" in note for note in log.get("notes", [])) == warned
