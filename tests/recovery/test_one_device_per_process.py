"""One process that sees several GPUs: the Trainer would wrap the student in DataParallel (a batch per GPU the
budget never counted, `local` across replicas, the hidden-state hooks recording one replica's slice). `recover` and
``FlattenConfig(heal=...)`` refuse it before any weight changes; a launcher's process, the CPU, and a model already
spread over the GPUs are left alone. The GPUs are simulated (`torch.cuda` patched): the check reads only the count."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import tiny_recovery_config
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.arguments import check_one_device_per_process

MESSAGE = "this one process sees 2 GPUs"


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_recover_refuses_one_process_over_two_gpus_before_any_change(compressed, two_gpus, monkeypatch):
    import optimum_flatten.recovery.trainer as trainer

    monkeypatch.setattr(trainer, "run_phases", lambda *a, **k: pytest.fail("trained before refusing"))
    dense, model, report = compressed
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"{MESSAGE}.*torchrun --nproc-per-node 2.*CUDA_VISIBLE_DEVICES=0"):
        recover(model, tiny_models.CharTokenizer(), tiny_models.sample_texts(), tiny_recovery_config(mode="full"),
                teacher=dense, report=report)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_heal_on_compress_refuses_it_before_compressing(two_gpus, monkeypatch):
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = FlattenConfig(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=4, seqlen=24,
                           heal={"max_tokens": 64, "seqlen": 16, "mode": "full"})  # fmt: skip
    with pytest.raises(ValueError, match=MESSAGE):
        FlattenQuantizer(config, progress=False).compress(model, tiny_models.CharTokenizer())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_launch_the_cpu_and_a_spread_model_are_left_alone(two_gpus, monkeypatch):
    model = tiny_models.tiny_llama_gqa()
    check_one_device_per_process(model, tiny_recovery_config(extra_training_args={"use_cpu": True}))
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    check_one_device_per_process(model, tiny_recovery_config())
    model.hf_device_map = {"": 1}  # the Trainer's model parallelism: not the device it would train on
    check_one_device_per_process(model, tiny_recovery_config())
    model.hf_device_map = {"model": 0, "lm_head": "cpu"}  # one GPU, the Trainer's own: it wraps this one
    with pytest.raises(ValueError, match=MESSAGE):
        check_one_device_per_process(model, tiny_recovery_config())
    del model.hf_device_map
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_one_device_per_process(model, tiny_recovery_config())
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=MESSAGE):
        check_one_device_per_process(model, tiny_recovery_config())


def test_compress_on_load_refuses_a_healing_fsdp2_would_shard_before_compressing(tmp_path):
    """transformers keeps the model it loaded whatever the quantizer returns, and after an FSDP2 healing rank 0's
    whole model is another object: refused in the preflight, before any weight changes."""
    from transformers import AutoModelForCausalLM

    tiny_models.tiny_llama_gqa().save_pretrained(tmp_path)
    tiny_models.tiny_hf_tokenizer().save_pretrained(tmp_path)
    fsdp = {"fsdp": True, "fsdp_config": {"version": 2}}
    heal = {"max_tokens": 64, "seqlen": 16, "mode": "full", "extra_training_args": fsdp}
    config = FlattenConfig(num_layers_to_remove=2, dataset=tiny_models.sample_texts(), nsamples=4, seqlen=24, heal=heal)
    with pytest.raises(ValueError, match="compress-on-load hands back the model transformers loaded"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
