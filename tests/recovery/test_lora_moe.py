"""LoRA healing on mixture-of-experts families, through compress-and-heal and `FlattenQuantizer.save`: the default
targets are attention's projections there (peft would map MLP names onto the fused experts, which it adapts only
without dropout), and the healed checkpoint reloads with plain transformers to the same logits."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from common import compress
from optimum_flatten.recovery.lora import default_target_modules

HEAL = dict(mode="lora", max_tokens=64, seqlen=32, per_device_train_batch_size=2, heldout_rows=0,
            learning_rate=1e-2, extra_training_args={"disable_tqdm": True})  # fmt: skip


@pytest.mark.parametrize("family", ["tiny_mixtral", "tiny_qwen3_moe", "tiny_qwen2_moe"])
def test_lora_heals_a_mixture_of_experts_model_saved_and_reloaded(tmp_path, family):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = getattr(tiny_models, family)()
    assert default_target_modules(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    quantizer = compress(model, "shortgpt", tiny_models.tiny_hf_tokenizer(), num_layers_to_remove=2, heal=HEAL)
    log = quantizer.report["recovery"]
    assert log["mode"] == "lora" and log["lora"]["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert log["steps"] == 1 and log["tokens_trained"] == 64
    path = quantizer.save(model, tmp_path / "healed", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-5)
