"""Mode 'local': which spans it trains, its loss against a hand-run reference, what it leaves untouched, refusals."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, logits, sample_ids, shallower_reference, tiny_recovery_config
from optimum_flatten.cli.main import main
from optimum_flatten.export.model_card import render_model_card
from optimum_flatten.recovery import RecoveryConfig, recover
from optimum_flatten.recovery.data import build_training_rows
from optimum_flatten.recovery.local import LocalSpanLoss
from optimum_flatten.recovery.selection import Span, changed_spans, span_parameter_names

#: ShortGPT-like plan of the 6-layer tiny model: layers 0 and 3 dropped (0 before the first kept one).
DROP_PLAN = {"plan": {"groups": [[1], [2], [4], [5]], "num_layers": 6}}


def _config(**overrides) -> RecoveryConfig:
    return tiny_recovery_config(**{"mode": "local", "learning_rate": 1e-3, **overrides})


@pytest.fixture(scope="module")
def dropped():
    """(dense teacher, the dense model with layers 0 and 3 dropped, its plan)."""
    dense = tiny_models.tiny_llama_gqa()
    return dense, shallower_reference(dense, [1, 2, 4, 5]), DROP_PLAN


def _batch() -> dict[str, torch.Tensor]:
    """Two rows of 20 tokens, the second right-padded over its last 7."""
    ids = sample_ids(batch=2, length=20, seed=3)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    ids[1, -7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_spans_are_the_blocks_that_are_not_one_plain_kept_layer(compressed, dropped):
    _, model, report = compressed
    groups = report["plan"]["groups"]
    bridged = {m["output_layer"] for m in report["linear_replacement"]["maps"]}
    spans = changed_spans(model, report)
    expected = {k for k, g in enumerate(groups) if len(g) > 1} | bridged
    assert {s.block for s in spans} == expected
    assert all(s.start == groups[s.block][0] for s in spans if s.block > 0)
    # A plan that only drops: block 0 covers the dropped layer 0 before it, block 1 the dropped layer 3 after it.
    _, student, plan = dropped
    assert changed_spans(student, plan) == [Span(0, 0, 2), Span(1, 2, 4)]


@torch.no_grad()
def _by_hand(student, teacher, spans, batch, state_loss: str = "pooled") -> float:
    """The local loss in float64 from the teachers' and the student's layers called by hand, with a hand-made mask."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    length = ids.shape[1]
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)) & mask[:, None, :].bool()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
    positions = torch.arange(length)[None].expand_as(ids)
    states = [teacher.model.embed_tokens(ids)]
    rotary = teacher.model.rotary_emb(states[0], positions)
    for layer in teacher.model.layers:
        states.append(layer(states[-1], attention_mask=additive, position_embeddings=rotary, position_ids=positions))
    real = mask.bool()
    terms = []
    for span in spans:
        block = student.model.layers[span.block]
        out = block(states[span.start], attention_mask=additive, position_embeddings=rotary, position_ids=positions)
        target = states[span.end].double()[real]
        error = (out.double()[real] - target) ** 2
        if state_loss == "pooled":
            terms.append(float(error.sum() / (target**2).sum()))
        else:  # each real position against its own state, then the mean over positions
            terms.append(sum(float(error[t].sum() / (target[t] ** 2).sum()) for t in range(len(target))) / len(target))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("state_loss", ["pooled", "per_token"])
@pytest.mark.parametrize("which", ["compressed", "dropped"])
def test_local_loss_equals_the_layers_run_by_hand(which, state_loss, request):
    dense, model, report = request.getfixturevalue(which)
    spans = changed_spans(model, report)
    parts = LocalSpanLoss(model, dense, spans, state_loss)(model, _batch())
    expected = _by_hand(model, dense, spans, _batch(), state_loss)
    assert parts.tokens == 20 + 13
    assert float(parts.total.detach()) == pytest.approx(expected, rel=1e-5)
    assert expected > 1e-3  # the spans really differ from the teacher: not a comparison of zeros


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2", "gemma2", "gemma3_text", "gpt2", "gpt2_layer_scaled"])
def test_a_span_of_one_unchanged_layer_has_zero_loss_on_every_family(family):
    """Each block of a copy of the teacher, marked changed (as if bridged), reproduces the teacher's layer exactly:
    it gets the call arguments of its own position (sliding or full mask, rotary or learned positions, GPT-2's
    per-layer scale), so a block called with another layer's arguments would show here."""
    factory = tiny_models.FACTORIES.get(family) or getattr(tiny_models, f"tiny_{family}")
    teacher = factory()
    student = copy.deepcopy(teacher)
    report = {
        "plan": {"groups": [[i] for i in range(6)], "num_layers": 6},
        "linear_replacement": {"maps": [{"output_layer": k} for k in range(6)]},
    }
    spans = changed_spans(student, report)
    assert [(s.start, s.end) for s in spans] == [(k, k + 1) for k in range(6)]
    ids = sample_ids(batch=2, length=24, seed=1)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with torch.no_grad():
        terms, _ = LocalSpanLoss(student, teacher, spans).span_terms({"input_ids": ids, "attention_mask": mask})
    assert [float(t) for t in terms] == [0.0] * 6


def test_a_student_equal_to_its_teacher_is_refused_before_any_change(compressed):
    dense = copy.deepcopy(compressed[0])
    plain = {"plan": {"groups": [[i] for i in range(6)], "num_layers": 6}}
    _refused(dense, "found no changed span", config=_config(), teacher=compressed[0], report=plain)


def test_local_trains_the_changed_blocks_and_leaves_every_other_parameter_bit_identical(compressed):
    dense, model, report = compressed
    model = copy.deepcopy(model)
    spans = changed_spans(model, report)
    names = set(span_parameter_names(model, spans))
    assert names and all(n.startswith(tuple(f"model.layers.{s.block}." for s in spans)) for n in names)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    healed, log = recover(
        model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), _config(), teacher=dense, report=report
    )
    assert log["mode"] == "local" and log["loss"] == "local" and log["tokens_trained"] == 256
    assert [s["block"] for s in log["local"]["spans"]] == [s.block for s in spans]
    for name, tensor in healed.state_dict().items():
        assert torch.equal(tensor, before[name]) == (name not in names), name
    assert all(p.requires_grad for p in healed.parameters())  # the flags are given back as they were


def test_local_heals_a_plan_that_only_drops_and_the_gate_never_ends_worse(dropped):
    dense, student, plan = dropped
    student = copy.deepcopy(student)
    loss = LocalSpanLoss(student, dense, changed_spans(student, plan))
    rows = build_training_rows(tiny_models.CharTokenizer(), tiny_models.sample_texts(), "text", 32, None, 0)
    text = {key: torch.stack([row[key] for row in rows[:8]]) for key in rows[0]}
    with torch.no_grad():
        start = float(loss(student, text).total)
    config = _config(max_tokens=1024, heldout_rows=4, eval_every=2, patience=0, learning_rate=3e-3)
    healed, log = recover(
        student, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=dense, report=plan
    )
    assert log["local"]["heldout_local_after"] < log["local"]["heldout_local_before"]
    assert log["heldout_after"]["objective"] <= log["heldout_before"]["objective"]
    with torch.no_grad():
        assert float(loss(healed, text).total) < 0.6 * start  # the local loss really goes down
    untouched = shallower_reference(dense, [1, 2, 4, 5])
    assert torch.equal(healed.model.layers[2].mlp.up_proj.weight, untouched.model.layers[2].mlp.up_proj.weight)


def test_a_global_phase_follows_with_its_own_budget(compressed):
    dense, model, report = compressed
    config = _config(max_tokens=128, local_then_global_tokens=64, heldout_rows=2, learning_rate=None)
    _, log = recover(
        copy.deepcopy(model),
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        config,
        teacher=dense,
        report=report,
    )
    assert log["global_phase"]["tokens_trained"] == 64 and log["global_phase"]["loss"] == "distillation"
    assert log["tokens_trained"] == 128 + 64 and log["steps"] == 2 + 1
    # The global phase trains the changed blocks on the global loss at mode 'changed''s rate, not the local one.
    scale = log["weight_scale"]
    assert log["learning_rate"] == pytest.approx(RecoveryConfig(mode="local").rate_for(scale))
    assert log["global_phase"]["learning_rate"] == pytest.approx(RecoveryConfig(mode="changed").rate_for(scale))
    given = _config(max_tokens=128, local_then_global_tokens=64, heldout_rows=2, learning_rate=3e-4)
    _, log = recover(
        copy.deepcopy(model), tiny_models.CharTokenizer(), tiny_models.sample_texts(), given, teacher=dense,
        report=report,
    )  # fmt: skip
    assert log["learning_rate"] == log["global_phase"]["learning_rate"] == 3e-4
    assert log["heldout_after"] == log["global_phase"]["heldout_after"]
    # global_learning_rate sets the global phase's alone, over learning_rate and over the scope's default.
    for first in (3e-4, None):
        apart = dataclasses.replace(given, learning_rate=first, global_learning_rate=7e-5)
        _, log = recover(
            copy.deepcopy(model), tiny_models.CharTokenizer(), tiny_models.sample_texts(), apart, teacher=dense,
            report=report,
        )  # fmt: skip
        assert log["global_phase"]["learning_rate"] == 7e-5
        local = first if first is not None else RecoveryConfig(mode="local").rate_for(scale)
        assert log["learning_rate"] == pytest.approx(local)


@pytest.mark.parametrize("scope", ["spans", "all"])
def test_the_global_phase_trains_the_spans_or_every_parameter(compressed, scope):
    """`global_scope`: 'spans' leaves every parameter outside the changed spans bit-identical through both phases;
    'all' trains them in the global phase, at mode 'full''s rate, and both phases leave every flag as it was."""
    dense, model, report = compressed
    spans = changed_spans(model, report)
    inside = set(span_parameter_names(model, spans))
    outside = [name for name, _ in model.named_parameters() if name not in inside]
    assert outside  # the embeddings, the final norm and the blocks no span covers
    config = _config(
        max_tokens=64, local_then_global_tokens=128, heldout_rows=0, learning_rate=None, global_scope=scope
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    healed, log = recover(
        copy.deepcopy(model), tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=dense,
        report=report,
    )  # fmt: skip
    after = dict(healed.named_parameters())
    changed = [name for name in outside if not torch.equal(after[name], before[name])]
    rate = RecoveryConfig(mode="changed" if scope == "spans" else "full").rate_for(log["weight_scale"])
    assert log["global_phase"]["learning_rate"] == pytest.approx(rate)
    assert log["global_phase"]["trained"] == ("the same blocks" if scope == "spans" else "every parameter")
    assert (changed == []) if scope == "spans" else (len(changed) == len(outside))
    assert all(p.requires_grad for p in healed.parameters())
    card = render_model_card({**report, "recovery": log})
    assert ("Then every parameter on the global" in card) == (scope == "all")
    assert ("every other parameter is unchanged" in card) == (scope == "spans")


def test_an_unknown_global_scope_is_refused(compressed):
    dense, model, report = compressed
    _refused(
        copy.deepcopy(model),
        "global_scope must be one of",
        config=_config(local_then_global_tokens=64, global_scope="everything"),
        teacher=dense,
        report=report,
    )


@pytest.mark.parametrize("rate", [0.0, -1e-4, float("nan")])
def test_a_global_rate_that_is_not_positive_is_refused_when_the_config_is_made(rate):
    with pytest.raises(ValueError, match="global_learning_rate must be a positive number"):
        _config(local_then_global_tokens=64, global_learning_rate=rate)


def test_local_saves_a_checkpoint_plain_transformers_reloads(compressed, tmp_path):
    dense, model, report = compressed
    healed, _ = recover(
        copy.deepcopy(model),
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        _config(),
        teacher=dense,
        report=report,
    )
    healed.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.num_hidden_layers == 4
    assert_close(logits(reloaded, sample_ids()), logits(healed, sample_ids()))


def test_cli_compress_a_plain_layer_drop_then_heal_locally(tmp_path, capsys):
    """ShortGPT only drops layers: 'changed' has nothing to train there, 'local' trains the blocks before the gaps;
    the report and the model card say which."""
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    tiny_models.tiny_hf_tokenizer().save_pretrained(dense)
    data = tmp_path / "text.txt"
    data.write_text("\n".join(tiny_models.sample_texts(200)))
    argv = [
        *("compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "2", "--dataset", str(data)),
        *("--nsamples", "4", "--seqlen", "32", "--no-progress", "--output", str(tmp_path / "out")),
        *("--heal-tokens", "256", "--heal-mode", "local"),
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "flatten_report.json").read_text())
    assert report["recovery"]["mode"] == "local" and report["recovery"]["local"]["spans"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- Healing: mode `local`" in card and "Trained locally" in card
    capsys.readouterr()


def _refused(model, message, **kwargs) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        recover(model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


def test_bad_input_is_refused_before_any_change(compressed):
    dense, model, report = compressed
    model = copy.deepcopy(model)
    _refused(model, "mode='local' trains each changed span towards the teacher", config=_config(), teacher=False)
    _refused(model, "no report was given", config=_config(), teacher=dense, report=None)
    _refused(
        model,
        "local_then_global_tokens continues mode 'local'",
        config=_config(mode="full", local_then_global_tokens=64),
        teacher=dense,
    )
    _refused(
        model,
        "max_tokens=1000000 needs",
        config=_config(local_then_global_tokens=1_000_000),
        teacher=dense,
        report=report,
    )
    shallow = shallower_reference(dense, [0, 1, 2, 3])
    # Refused once the teacher is loaded, before the fingerprint's warning and the spans' own check.
    _refused(model, "maps the model's blocks onto 6 original layers, and the teacher has 4", config=_config(),
             teacher=shallow, report=report)  # fmt: skip
