"""compensation="scale" (Prune&Comp): the fold leaves the function unchanged, the measured α is the paper's."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids, shallower_reference, tiny_config
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.corrections.compensation import fold_stream_scales_
from optimum_flatten.utils.errors import UnsupportedArchitectureError


def _config(method: str = "shortgpt", n: int = 1, **options) -> FlattenConfig:
    return tiny_config(method, num_layers_to_remove=n, **options)


def _negligible_norm_eps(model) -> None:
    """The fold is exact up to the norms' ε (relative error about ε / mean(x²), 2e-3 on these tiny activations with
    ε = 1e-6): a negligible ε isolates the fold itself."""
    for module in model.modules():
        for name in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-12)


@pytest.mark.parametrize("factory", ["llama_gqa", "gpt2", "qwen2"])
@pytest.mark.parametrize("alpha", [0.37, 2.5])
def test_folding_one_factor_everywhere_leaves_the_logits_unchanged(factory, alpha):
    model = tiny_models.FACTORIES[factory]()
    if factory == "llama_gqa":  # a tied LLaMA too: the final norm must absorb the factor
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    _negligible_norm_eps(model)
    ids = sample_ids(batch=2, length=16, seed=1)
    expected = logits(model, ids)
    adapter = get_adapter(model)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    fold_stream_scales_(adapter, "decoder", [alpha] * adapter.num_layers("decoder"), alpha)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied  # never untied
    torch.testing.assert_close(logits(model, ids), expected, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def _naive_alpha(model, batches, layer: int) -> float:
    before, after = [], []
    for batch in batches:
        hidden = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
        ).hidden_states
        keep = batch.attention_mask.bool()
        before.append(hidden[layer][keep].double())
        after.append(hidden[layer + 1][keep].double())
    a, b = torch.cat(before).abs().mean(dim=0), torch.cat(after).abs().mean(dim=0)
    return float((b / a).mean())


@pytest.mark.parametrize("factory", ["qwen3", "llama_gqa"])  # ShortGPT drops layer 3, and layer 0 (embedding only)
def test_one_drop_measures_the_paper_alpha_and_equals_scaling_the_stream_at_the_cut(factory):
    model = tiny_models.FACTORIES[factory]()
    _negligible_norm_eps(model)
    original = copy.deepcopy(model)
    config = _config(compensation="scale")
    quantizer = compress(model, config)
    (dropped,) = quantizer.plan.dropped_indices
    assert dropped < 5  # the next layer's input is a hidden state of the model (not after the final norm)
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    alpha = quantizer.report["compensation"]["alpha"][str(dropped)]
    assert alpha == pytest.approx(_naive_alpha(original, batches, dropped), rel=1e-5)

    ids = sample_ids(batch=2, length=16, seed=2)
    kept = [i for i in range(6) if i != dropped]
    reference = shallower_reference(original, kept)
    _negligible_norm_eps(reference)
    reference.model.layers[dropped].register_forward_pre_hook(
        lambda _m, args, kwargs: (
            ((args[0] * alpha, *args[1:]), kwargs)
            if args
            else ((), {**kwargs, "hidden_states": kwargs["hidden_states"] * alpha})
        ),
        with_kwargs=True,
    )
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=2e-5, rtol=1e-4)
    plain = shallower_reference(original, kept)
    _negligible_norm_eps(plain)
    assert not torch.allclose(logits(model, ids), logits(plain, ids), atol=1e-3)


def test_compensated_checkpoint_reloads_with_plain_transformers_and_keeps_the_tie(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["gpt2"]()
    quantizer = compress(model, _config("uidl", n=2, compensation="scale"))
    assert set(quantizer.report["compensation"]["alpha"]) == {str(i) for i in quantizer.plan.dropped_indices}
    quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight
    ids = sample_ids(batch=2, length=16, seed=3)
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


def test_bad_compensation_requests_are_refused_before_any_weight_changes():
    with pytest.raises(ValueError, match=r"unknown compensation 'scal'.*scale"):
        _config(compensation="scal")
    with pytest.raises(ValueError, match="merges layers"):
        _config("flattengpt", compensation="scale")
    with pytest.raises(ValueError, match="keeps every layer"):
        FlattenConfig(method="ffn_merge", dataset=["x"], compensation="scale")
    with pytest.raises(ValueError, match="choose one of them"):
        _config(compensation="scale", linear_replacement="lstsq")
    with pytest.raises(ValueError, match="fits its own linear replacement"):
        _config("replaceme", compensation="scale")
    bert = tiny_models.FACTORIES["bert"]()
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    with pytest.raises(UnsupportedArchitectureError, match="pre-norm"):
        compress(bert, _config(compensation="scale"))
    for key, value in bert.state_dict().items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0)
