from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten.recovery import RecoveryConfig, load_recovery_texts, recover
from optimum_flatten.recovery.data import build_training_rows
from optimum_flatten.recovery.lora import default_target_modules


def test_alpaca_records_are_formatted_and_padding_is_not_learned(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    records = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records))
    texts, kind = load_recovery_texts(str(path))
    assert kind == "alpaca"
    assert "### Instruction:\nName a colour." in texts[0] and "### Input:" not in texts[0]
    assert "### Input:\n2 and 3\n\n### Response:\n5" in texts[1]
    rows = build_training_rows(tiny_models.CharTokenizer(), texts, kind, seqlen=400, max_samples=None, seed=0)
    for row in rows:
        assert (row["labels"][row["attention_mask"] == 0] == -100).all()
        assert (row["labels"][row["attention_mask"] == 1] == row["input_ids"][row["attention_mask"] == 1]).all()


def test_lora_recovery_trains_only_the_chosen_renumbered_layers_and_merges_to_plain(tmp_path):
    model = tiny_models.tiny_llama_gqa()
    compress(model, "flattengpt", num_layers_to_remove=2)
    assert default_target_modules(model) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = RecoveryConfig(
        max_steps=3,
        seqlen=32,
        per_device_train_batch_size=2,
        learning_rate=5e-2,
        layers_to_transform=[1, 3],
        logging_steps=1,
    )
    merged, log = recover(model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), config)
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert log["steps"] == 3 and log["data_kind"] == "text" and len(log["loss_history"]) == 3
    state = merged.state_dict()
    assert not any("lora" in k for k in state)
    assert set(state) == set(before)
    for name, tensor in state.items():
        changed = not torch.equal(tensor, before[name])
        in_target = name.startswith(("model.layers.1.", "model.layers.3.")) and name.endswith("proj.weight")
        assert changed == in_target, name
    merged.save_pretrained(tmp_path / "recovered")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "recovered")
    assert reloaded.config.num_hidden_layers == 4
    assert_close(logits(reloaded, sample_ids()), logits(merged, sample_ids()))


def test_the_log_and_card_give_the_rows_an_optimiser_step_reads_accumulation_included():
    """`rows_per_step` is the batch times the accumulation on one process, so that steps × rows × seqlen is the
    `tokens_trained` the log reports, and the model card says the same."""
    from optimum_flatten.export.model_card import render_model_card

    config = RecoveryConfig(
        mode="full", max_steps=2, seqlen=32, per_device_train_batch_size=2, gradient_accumulation_steps=3,
        heldout_rows=0, learning_rate=1e-4,
    )  # fmt: skip
    _, log = recover(tiny_models.tiny_llama_gqa(), tiny_models.CharTokenizer(), tiny_models.sample_texts(), config,
                     teacher=False)  # fmt: skip
    assert (log["steps"], log["rows_per_step"], log["seqlen"]) == (2, 6, 32)
    assert log["tokens_trained"] == 2 * 6 * 32
    card = render_model_card({"recovery": log})
    assert "(384 tokens, 2 steps of 6 rows x 32 tokens a process)" in card
