"""``FlattenConfig(heal=...)``: one call compresses and heals (distilled from the dense weights), refusals first."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import tiny_models
from common import compress, sample_ids, tiny_config
from optimum_flatten.cli.main import main
from optimum_flatten.recovery import RecoveryConfig, recover

HEAL = dict(
    max_tokens=128,
    mode="changed",
    seqlen=32,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    heldout_rows=2,
    eval_every=1,
    extra_training_args={"disable_tqdm": True},
)


def test_compress_with_heal_equals_compress_then_recover_from_the_dense_model():
    """The one-line form is the two-step form: compress, then `recover` with the dense weights as the teacher."""
    dense = tiny_models.tiny_llama_gqa()
    one_line = copy.deepcopy(dense)
    torch.manual_seed(0)
    quantizer = compress(one_line, "flattengpt", num_layers_to_remove=2, heal=HEAL)
    log = quantizer.report["recovery"]
    assert log["mode"] == "changed" and log["loss"] == "distillation" and log["tokens_trained"] == 128
    assert quantizer.report["num_layers_after"] == 4 and len(one_line.model.layers) == 4

    two_step = copy.deepcopy(dense)
    reference = compress(two_step, "flattengpt", num_layers_to_remove=2)
    torch.manual_seed(0)
    healed, _ = recover(
        two_step,
        tiny_models.CharTokenizer(),
        tiny_models.sample_texts(),
        RecoveryConfig(**HEAL),
        teacher=dense,
        report=reference.report,
    )
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(one_line(ids).logits, healed(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["changed", "lora"])
def test_compress_and_heal_on_load_equals_the_quantizers_own_call(tmp_path, mode):
    """``from_pretrained(..., quantization_config=FlattenConfig(heal=...))`` heals as `FlattenQuantizer.compress` does
    (transformers marked the model quantized before compressing it, which the Trainer refused to train), and the
    healed model saves and reloads as a plain checkpoint."""
    from transformers import AutoModelForCausalLM

    tiny_models.tiny_llama_gqa().save_pretrained(tmp_path / "dense")
    options = dict(num_layers_to_remove=2, heal={**HEAL, "mode": mode})
    torch.manual_seed(0)
    config = tiny_config("flattengpt", **options, tokenizer=tiny_models.CharTokenizer())
    on_load = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=config)
    assert on_load.flatten_report["recovery"]["mode"] == mode and not getattr(on_load, "is_quantized", False)
    explicit = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    torch.manual_seed(0)
    compress(explicit, "flattengpt", **options)
    ids = sample_ids()
    on_load.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(on_load(ids).logits, explicit(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(reloaded(ids).logits, on_load(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("method", "free", "mode"),
    [("flattengpt", 2**50, "local"), ("replaceme", 2**50, "full"), ("flattengpt", 2**10, "local")],
)
def test_the_default_heal_mode_is_chosen_once_before_compressing_from_the_dense_model_and_its_teacher_copy(
    monkeypatch, method, free, mode
):
    """The memory is asked once, on the dense model. Where `full` fits it is the default, and once the plan is known
    a plan that merged layers (FlattenGPT's pairs) splits the budget between `local` and the global loss instead."""
    from optimum_flatten.recovery import footprint

    asked = []

    def available(device):
        asked.append(len(model.model.layers))  # the depth when asked: the dense model's, before any change
        return free

    monkeypatch.setattr(footprint, "available_bytes", available)
    model = tiny_models.tiny_llama_gqa()
    heal = {k: v for k, v in HEAL.items() if k not in ("mode", "learning_rate")}
    quantizer = compress(model, method, num_layers_to_remove=2, heal=heal)
    recovery = quantizer.report["recovery"]
    assert recovery["mode"] == mode
    assert recovery["mode_chosen"].startswith("the default (full healing adds about")
    split = free == 2**50 and method == "flattengpt"
    assert ("global_phase" in recovery) == split
    assert recovery["mode_chosen"].endswith("local, then the global loss, half the budget each") == split
    assert asked == [6]
    from optimum_flatten.export.model_card import render_model_card

    assert f"- Healing: mode `{mode}` (the default), distilled" in render_model_card(dict(quantizer.report))


@pytest.mark.parametrize(
    ("heal", "message"),
    [
        ({**HEAL, "max_tokens": 10**9}, "max_tokens=1000000000 needs"),
        ({**HEAL, "mode": "everything"}, "everything"),
        ({**HEAL, "modes": "changed"}, "Did you mean 'mode'"),
        (0, "positive training-token budget"),
        ({**HEAL, "mode": "last_k", "last_k": 5}, "the compressed model keeps 4; lower last_k"),
        ({**HEAL, "mode": "last_k", "last_k": 0}, "last_k must be a whole number of at least 1"),
        ({**HEAL, "per_device_train_batch_size": 0}, "per_device_train_batch_size must be"),
        # Loss, gate and optimiser options the losses, the gate, peft, torch or the Trainer refused only once the
        # healing started, after the compression (review J).
        ({**HEAL, "temperature": 0.0}, "temperature must be a positive number"),
        ({**HEAL, "kd_alpha": float("nan")}, r"kd_alpha must be in \[0, 1\]"),
        ({**HEAL, "hidden_weight": -1.0}, "hidden_weight must be a number of at least 0"),
        ({**HEAL, "chunk_size": 0}, "chunk_size must be a whole number of at least 1"),
        ({**HEAL, "eval_every": 0}, "eval_every must be a whole number of at least 1"),
        ({**HEAL, "patience": -1}, "patience must be a whole number of at least 0"),
        ({**HEAL, "logging_steps": 0}, "logging_steps must be a whole number of at least 1"),
        ({**HEAL, "learning_rate": 0.0}, "learning_rate must be a positive number"),
        ({**HEAL, "learning_rate": float("nan")}, "learning_rate must be a positive number"),
        ({**HEAL, "mode": "lora", "learning_rate": None, "r": 0}, "r must be a whole number of at least 1"),
        ({**HEAL, "mode": "lora", "learning_rate": None, "lora_dropout": 2.0}, r"lora_dropout must be in \[0, 1\)"),
        ({**HEAL, "extra_training_args": {"no_such_arg": 1}}, "TrainingArguments has no field for"),
        ({**HEAL, "extra_training_args": {"learning_rate": -1}}, "learning_rate must be a positive number"),
    ],
)
def test_a_heal_that_cannot_run_is_refused_before_any_weight_changes(heal, message):
    model = tiny_models.tiny_llama_gqa()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises((ValueError, TypeError), match=message):
        compress(model, "flattengpt", num_layers_to_remove=2, heal=heal)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_heal_changed_after_a_plain_layer_drop_is_refused_before_compressing():
    model = tiny_models.tiny_llama_gqa()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="only drops whole layers"):
        compress(model, "shortgpt", num_layers_to_remove=2, heal=HEAL)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_heal_changed_after_a_method_that_keeps_every_layer_is_refused_without_advice_it_would_refuse():
    model = tiny_models.tiny_llama_gqa()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="ffn_merge keeps every layer; heal with mode 'full'") as refused:
        compress(model, "ffn_merge", heal=HEAL)
    assert "linear_replacement" not in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_compress_heal_tokens(tmp_path, capsys):
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    tiny_models.tiny_hf_tokenizer().save_pretrained(dense)
    data = tmp_path / "text.txt"
    data.write_text("\n".join(tiny_models.sample_texts(200)))
    argv = [
        *("compress", str(dense), "--num-layers-to-remove", "2", "--dataset", str(data), "--nsamples", "4"),
        *("--seqlen", "32", "--no-progress", "--output", str(tmp_path / "out")),
        *("--heal-tokens", "256", "--heal-mode", "full"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "healing" in out and "full" in out
    report = json.loads((tmp_path / "out" / "flatten_report.json").read_text())
    assert report["recovery"]["mode"] == "full" and report["recovery"]["tokens_trained"] >= 256
    assert "- Healing: mode `full`," in (tmp_path / "out" / "README.md").read_text()  # given, not the default
    assert main([*argv[:-4], "--heal-mode", "full", "--overwrite"]) == 2
    assert "need --heal-tokens" in capsys.readouterr().err


def test_a_teacher_that_is_not_the_source_is_named_in_a_warning():
    """The report keeps a fingerprint of the dense weights (no path); another model as teacher is warned about and
    noted in the log, the right one (in another dtype too) is not."""
    from optimum_flatten.utils.fingerprint import weights_fingerprint

    dense = tiny_models.tiny_llama_gqa()
    model = copy.deepcopy(dense)
    report = compress(model, "flattengpt", num_layers_to_remove=2).report
    assert report["source_fingerprint"] == weights_fingerprint(dense)
    assert weights_fingerprint(copy.deepcopy(dense).to(torch.bfloat16)) == weights_fingerprint(dense)
    config = RecoveryConfig(**{**HEAL, "max_tokens": 64})
    texts = tiny_models.sample_texts()
    _, log = recover(copy.deepcopy(model), tiny_models.CharTokenizer(), texts, config, teacher=dense, report=report)
    assert "notes" not in log
    other = tiny_models.tiny_llama_gqa()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    with pytest.warns(UserWarning, match="not the model this checkpoint was compressed from"):
        _, log = recover(copy.deepcopy(model), tiny_models.CharTokenizer(), texts, config, teacher=other, report=report)
    assert any("fingerprint differs" in note for note in log["notes"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["changed", "lora", "local"])
def test_healing_in_bfloat16_on_cuda_keeps_placement_and_dtype_and_lowers_the_held_out_objective(mode):
    """On a CUDA device in bfloat16: the teacher and the student stay on the device and in bfloat16, the healed model
    reloads as it is, and the gate's held-out objective does not rise (the gate keeps the input otherwise)."""
    dense = tiny_models.tiny_llama_gqa().to("cuda", torch.bfloat16)
    model = copy.deepcopy(dense)
    report = compress(model, "flattengpt", num_layers_to_remove=2).report
    config = RecoveryConfig(**{**HEAL, "mode": mode, "max_tokens": 256})
    healed, log = recover(
        model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config, teacher=dense, report=report
    )
    parameters = list(healed.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in parameters)
    assert log["heldout_after"]["objective"] <= log["heldout_before"]["objective"]
    with torch.no_grad():
        assert torch.isfinite(healed(sample_ids().to("cuda")).logits.float()).all()


def test_training_rows_past_a_position_table_are_refused_before_any_weight_changes():
    """GPT-2's positions are a table (128 rows here): a training row of 256 would index past it inside the first
    step. Both entries refuse first, naming the option, and the weights are untouched."""
    from optimum_flatten.utils.errors import CalibrationDataError

    model = tiny_models.tiny_gpt2()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CalibrationDataError, match=r"the heal's seqlen=256 is longer than the 128 positions"):
        compress(model, "shortgpt", num_layers_to_remove=2, heal={**HEAL, "mode": "full", "seqlen": 256})
    with pytest.raises(CalibrationDataError, match=r"^the healing's seqlen=256 is longer than the 128 positions"):
        recover(
            model,
            tiny_models.CharTokenizer(),
            tiny_models.sample_texts(),
            RecoveryConfig(**{**HEAL, "mode": "full", "seqlen": 256}),
            teacher=False,
        )
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
