"""LoRA settings checked where a user gives them: a target that names nothing, a layer the healed model does not have
or an adapter on a tied embedding are refused before any weight changes (`quantize` used to refuse them only after
the compression, and a retry then compressed the model again); LoRA's options given to another mode are refused;
and the default targets skip what peft cannot adapt (a collapsed MLP's identity), naming by full path only the blocks
`layers_to_transform` keeps (peft's layer filter passes a full path by)."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from common import tiny_config, tiny_recovery_config
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.options.recovery import RecoveryConfig
from optimum_flatten.recovery import recover
from optimum_flatten.recovery.lora import wrap_lora


def _heal(**lora):
    return {
        "max_tokens": 256,
        "seqlen": 32,
        "per_device_train_batch_size": 2,
        "heldout_rows": 0,
        "mode": "lora",
        **lora,
    }


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            {"target_modules": ["qkv_proj"]},
            r"LoRA target_modules \['qkv_proj'\] name no module of this LlamaForCausalLM",
        ),
        (
            {"layers_to_transform": [5]},
            r"LoRA layers_to_transform \[5\] are not layers of the healed model, which has 4",
        ),
        (  # peft adapts a full path whatever layers_to_transform says
            {"target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"], "layers_to_transform": [1]},
            r"LoRA target_modules \['model.layers.0.self_attn.q_proj'\] are full module paths, which peft adapts",
        ),
    ],
)
def test_quantize_refuses_lora_settings_before_compressing(tmp_path, lora, message):
    dense = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    quantizer = FlattenQuantizer.from_pretrained(dense, tokenizer=tiny_models.CharTokenizer())
    config = tiny_config("shortgpt", num_layers_to_remove=2, heal=_heal(**lora))
    with pytest.raises(ValueError, match=message):
        quantizer.quantize(save_dir=tmp_path / "out", quantization_config=config)
    assert quantizer.model.config.num_hidden_layers == 6 and not (tmp_path / "out").exists()


def test_an_adapter_on_a_tied_embedding_is_refused():
    model = tiny_models.tiny_llama_gqa()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = tiny_models.CharTokenizer()
    texts = tiny_models.sample_texts()
    for target in ("lm_head", "embed_tokens"):
        config = tiny_recovery_config(mode="lora", target_modules=["q_proj", target])
        with pytest.raises(
            ValueError, match=rf"\['{target}'\] name the embedding or the LM head, which this model ties"
        ):
            recover(model, tokenizer, texts, config, teacher=False)


@pytest.mark.parametrize(
    "options", [{"mode": "full", "target_modules": ["q_proj"]}, {"mode": "last_k", "lora_alpha": 8}]
)
def test_lora_options_given_to_another_mode_are_refused(options):
    with pytest.raises(ValueError, match=r"of mode 'lora', and mode '(full|last_k)' would ignore"):
        RecoveryConfig(**options)
    with pytest.raises(ValueError, match=r"of mode 'lora'"):
        FlattenConfig(
            method="shortgpt", num_layers_to_remove=2, dataset=["a b"] * 4, heal={"max_tokens": 64, **options}
        )


def test_lora_options_are_refused_when_the_default_mode_is_another():
    """Without a mode the default decides: LoRA without a teacher (the options then apply), `full` with one, which
    would ignore them; refused once chosen, before any weight changes."""
    RecoveryConfig(r=16)  # the default mode is not known yet
    model = tiny_models.tiny_llama_gqa()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    texts = tiny_models.sample_texts()
    with pytest.raises(ValueError, match=r"r is an option of mode 'lora', and mode 'full'"):
        recover(
            model, tiny_models.CharTokenizer(), texts, tiny_recovery_config(r=16), teacher=tiny_models.tiny_llama_gqa()
        )
    config = FlattenConfig(
        method="shortgpt", num_layers_to_remove=2, dataset=texts, nsamples=8, seqlen=24, heal=_heal(mode=None, r=16)
    )
    with pytest.raises(ValueError, match=r"r is an option of mode 'lora'"):
        FlattenQuantizer(config, progress=False).compress(model, tiny_models.CharTokenizer())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_default_targets_skip_a_collapsed_mlps_identity():
    """A partly collapsed LayerCollapse GPT-2: the collapsed blocks' MLP down slot is an nn.Identity named c_proj,
    like attention's out projection; the defaults name the projections by their full paths there, and every
    projection peft can adapt gets an adapter."""
    from common import compress
    from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_

    model = tiny_models.tiny_gpt2()
    activations = prepare_layer_collapse_(model, num_mlps=2)
    for activation in activations.values():  # trained to linear, as LayerCollapse's training leaves them
        activation.alpha.data.fill_(1.0)
    compress(model, "layer_collapse", nsamples=4, seqlen=16)
    identities = [n for n, m in model.named_modules() if n.endswith("mlp.c_proj") and type(m).__name__ == "Identity"]
    assert identities == ["transformer.h.4.mlp.c_proj", "transformer.h.5.mlp.c_proj"]
    projections = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D" and ".h." in n}
    wrapped, _ = wrap_lora(model, RecoveryConfig(mode="lora"))
    adapted = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A")
        for n, _ in wrapped.named_modules()
        if n.endswith("lora_A")
    }
    assert adapted == projections and not adapted & set(identities)
    # The full paths and peft's layer filter together: layers_to_transform keeps the projections of those layers
    # only, the full-path ones (every c_proj) included.
    model = wrapped.unload()
    wrapped, _ = wrap_lora(model, RecoveryConfig(mode="lora", layers_to_transform=[0, 5]))
    kept = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in wrapped.named_modules()
            if n.endswith("lora_A")}  # fmt: skip
    assert kept == {n for n in projections if n.startswith(("transformer.h.0.", "transformer.h.5."))}
    assert "transformer.h.5.attn.c_proj" in kept and "transformer.h.5.mlp.c_fc" in kept
