"""The gate's guard (`RecoveryConfig.guard_text`, and in a mix the user's own held-out rows): a trained state is kept
only where the guard's objective is no higher than the input's; recorded in the log and printed by `recover`;
refused in one line before any weight changes when it cannot work."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import tiny_models
from common import compress, dense_and_compressed_on_disk
from optimum_flatten.cli.main import main
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.distill import LossParts
from optimum_flatten.recovery.gate import IMPROVED, KEPT_INPUT, HeldOutGate
from optimum_flatten.utils.errors import CalibrationDataError

TOKENIZER = tiny_models.CharTokenizer()
SMALL = dict(seqlen=32, per_device_train_batch_size=2, heldout_rows=4, eval_every=1, learning_rate=1e-3)
OBJECTIVE_ROW, GUARD_ROW = 0, 1


def _linear(weight: float) -> torch.nn.Linear:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(weight)
    return model


def _loss(model, batch):
    """(w - 1)² on the held-out rows, (w - 4)² on the guard's: the two disagree below w = 2.5."""
    target = 4.0 if int(batch["input_ids"][0, 0]) == GUARD_ROW else 1.0
    value = (model.weight[0, 0] - target) ** 2
    return LossParts(value, 0.0, float(value), 0.0, 1)


def _rows(kind: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.full((2,), kind, dtype=torch.long)}]


def _walk(gate: HeldOutGate, model: torch.nn.Linear, weights: list[float]) -> list[bool]:
    stops = []
    for step, weight in enumerate(weights, start=1):
        with torch.no_grad():
            model.weight.fill_(weight)
        stops.append(gate.evaluate(step))
    return stops


def test_a_better_state_whose_guard_got_worse_is_not_kept():
    model = _linear(5.0)  # objective 16, guard 1
    gate = HeldOutGate(model, _loss, _rows(OBJECTIVE_ROW), 1, 3, 1, guard=_rows(GUARD_ROW))
    # 3.0: objective 4, guard 1 (kept); 1.5: 0.25, guard 6.25 (refused); 2.0: 1, guard 4 (refused); 4.5: 12.25
    assert _walk(gate, model, [3.0, 1.5, 2.0, 4.5]) == [False, False, False, True]
    assert gate.restore_best_() == IMPROVED and gate.best_step == 1 and float(model.weight.detach()) == 3.0
    guard = gate.summary()["guard"]
    assert guard == {"rows": 1, "before": guard["before"], "after": guard["after"], "refused_steps": [2, 3]}
    assert (guard["before"]["objective"], guard["after"]["objective"]) == (1.0, 1.0)
    history = gate.summary()["heldout_history"]
    assert [entry["guard_objective"] for entry in history] == [1.0, 1.0, 6.25, 4.0, 0.25]
    assert [entry["guard_lm"] for entry in history] == [1.0, 1.0, 6.25, 4.0, 0.25]  # `_loss` puts it in `lm`
    assert all(entry["guard_kl"] == 0.0 for entry in history)

    unguarded_model = _linear(5.0)  # the same walk without a guard keeps the state the guard refused
    unguarded = HeldOutGate(unguarded_model, _loss, _rows(OBJECTIVE_ROW), 1, 3, 1)
    _walk(unguarded, unguarded_model, [3.0, 1.5, 2.0, 4.5])
    assert unguarded.best_step == 2 and "guard" not in unguarded.summary()


def test_a_guard_that_every_state_worsens_keeps_the_input_weights():
    model = _linear(4.0)  # guard 0 at the start: any move worsens it
    gate = HeldOutGate(model, _loss, _rows(OBJECTIVE_ROW), 1, 0, 1, guard=_rows(GUARD_ROW))
    _walk(gate, model, [3.0, 2.0, 1.0])
    assert gate.restore_best_() == KEPT_INPUT and float(model.weight.detach()) == 4.0
    assert gate.summary()["guard"]["refused_steps"] == [1, 2, 3]


def test_a_resumed_gate_keeps_its_guard_scores_and_refuses_a_state_without_them():
    model = _linear(5.0)
    gate = HeldOutGate(model, _loss, _rows(OBJECTIVE_ROW), 1, 3, 1, guard=_rows(GUARD_ROW))
    _walk(gate, model, [3.0, 1.5])
    resumed = HeldOutGate(model, _loss, _rows(OBJECTIVE_ROW), 1, 3, 1, state=gate.state_dict(), guard=_rows(GUARD_ROW))
    assert resumed.summary() == gate.summary()
    unguarded = HeldOutGate(_linear(5.0), _loss, _rows(OBJECTIVE_ROW), 1, 3, 1).state_dict()
    with pytest.raises(ValueError, match="the saved gate has no guard scores"):
        HeldOutGate(model, _loss, _rows(OBJECTIVE_ROW), 1, 3, 1, state=unguarded, guard=_rows(GUARD_ROW))


def test_a_mix_is_guarded_by_the_users_own_heldout_rows():
    config = RecoveryConfig(mode="full", max_tokens=256, teacher_text=0.5, **SMALL)
    _, log = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, tiny_models.sample_texts(), config,
                     teacher=tiny_models.tiny_llama_gqa())  # fmt: skip
    guard, user = log["guard"], log["heldout_parts"]["user"]
    assert guard["rows"] == user["rows"] == 2
    assert guard["before"]["objective"] == pytest.approx(user["before"]["objective"], rel=1e-5)  # the same rows
    assert guard["after"]["objective"] == pytest.approx(user["after"]["objective"], rel=1e-5)  # of the kept state
    assert guard["after"]["objective"] <= guard["before"]["objective"]


def test_guard_text_guards_a_healing_on_the_teacher_text_alone(tmp_path):
    guard_text = tmp_path / "guard.txt"
    guard_text.write_text("\n".join(tiny_models.sample_texts(30, seed=7)))
    config = RecoveryConfig(mode="full", max_tokens=256, guard_text=str(guard_text), **SMALL)
    _, log = recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, "teacher", config,
                     teacher=tiny_models.tiny_llama_gqa())  # fmt: skip
    guard, history = log["guard"], log["heldout_history"]
    assert guard["rows"] == 4 and len(history) == log["steps"] + 1
    assert history[0]["guard_objective"] == guard["before"]["objective"]
    best, best_step, refused = history[0]["objective"], 0, []  # the rule, replayed naively over the history
    for entry in history[1:]:
        if entry["objective"] < best:
            if entry["guard_objective"] <= guard["before"]["objective"]:
                best, best_step = entry["objective"], entry["step"]
            else:
                refused.append(entry["step"])
    assert (log["best_step"], guard["refused_steps"]) == (best_step, refused)
    kept = next(entry for entry in history if entry["step"] == best_step)
    assert kept["guard_objective"] == guard["after"]["objective"] <= guard["before"]["objective"]
    assert (history[0]["guard_lm"], kept["guard_lm"]) == (guard["before"]["lm"], guard["after"]["lm"])


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"heldout_rows": 0}, ValueError, "guard_text is scored by the gate"),
        ({"guard_text": "same"}, ValueError, "guard_text is the training text itself"),
        ({"guard_text": "short"}, CalibrationDataError, "guard_text holds no row of 32 tokens"),
    ],
)
def test_a_guard_that_cannot_work_is_refused_before_the_compression_touches_a_weight(tmp_path, options, error, message):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(60)))
    (tmp_path / "short.txt").write_text("too short")
    guard = {"same": str(text), "short": str(tmp_path / "short.txt")}.get(options.get("guard_text"), str(text) + "x")
    (tmp_path / "text.txtx").write_text("\n".join(tiny_models.sample_texts(30, seed=7)))
    heal = {**SMALL, "max_tokens": 128, "mode": "full", "dataset": str(text), **options, "guard_text": guard}
    model = tiny_models.tiny_llama_gqa()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=message) as refused:
        compress(model, "flattengpt", TOKENIZER, num_layers_to_remove=2, heal=heal)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_cli_recover_prints_and_records_the_guard(tmp_path, capsys):
    dense, compressed = dense_and_compressed_on_disk(tmp_path, tiny_models.tiny_hf_tokenizer())
    guard_text = tmp_path / "guard.txt"
    guard_text.write_text("\n".join(tiny_models.sample_texts(30, seed=7)))
    code = main([
        "recover", str(compressed), "--teacher", str(dense), "--dataset", "teacher", "--guard-text", str(guard_text),
        "--output", str(tmp_path / "healed"), "--seqlen", "32", "--per-device-train-batch-size", "2",
        "--heldout-rows", "2", "--eval-every", "1", "--max-tokens", "128", "--mode", "full",
    ])  # fmt: skip
    assert code == 0
    guard = json.loads((tmp_path / "healed" / "flatten_report.json").read_text())["recovery"]["guard"]
    assert guard["rows"] == 2 and str(guard_text) not in json.dumps(guard)  # reports keep no paths
    printed = capsys.readouterr().out
    start, kept = guard["before"], guard["after"]
    assert f"guard: objective {start['objective']:.4f} -> {kept['objective']:.4f}" in printed
    assert f"(perplexity {math.exp(start['lm']):.2f} -> {math.exp(kept['lm']):.2f})" in printed
    assert "unguarded" not in printed
    card = (tmp_path / "healed" / "README.md").read_text()  # the teacher wrote the text: the card says so
    assert "on the teacher's own text (from its start token) (128 tokens" in card
    assert f"- Guard text (not allowed to get worse): objective {start['objective']:.4f} -> " in card


def test_the_training_texts_given_again_as_the_guard_are_refused():
    texts = tiny_models.sample_texts()
    config = RecoveryConfig(mode="full", max_tokens=128, guard_text=list(texts), **SMALL)
    with pytest.raises(ValueError, match="guard_text is the training text itself"):
        recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, texts, config, teacher=tiny_models.tiny_llama_gqa())


def test_the_teachers_prompts_given_again_as_the_guard_are_refused():
    """The teacher's training rows open with the prompts' first tokens, trained on: as the guard they are no longer
    text the healing does not see."""
    texts, prompts = tiny_models.sample_texts(), tiny_models.sample_texts(30, seed=7)
    teacher = {"teacher_text": 0.5, "prompts": list(prompts), "teacher_prompt_tokens": 8}
    config = RecoveryConfig(mode="full", max_tokens=128, guard_text=list(prompts), **teacher, **SMALL)
    with pytest.raises(ValueError, match="guard_text is the prompts' text"):
        recover(tiny_models.tiny_llama_gqa(seed=1), TOKENIZER, texts, config, teacher=tiny_models.tiny_llama_gqa())
