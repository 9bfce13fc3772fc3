"""ReplaceMe with a stream gain: T and one scalar α fitted jointly (``α Y + M T ≈ L``) and α folded upstream."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, naive_fit_rows, sample_ids, shallower_reference, tiny_config
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.corrections.linear_bridge import BridgeOptions
from optimum_flatten.ops.linear_map import (
    LinearMapStatistics,
    solve_least_squares,
    solve_least_squares_with_gain,
)
from optimum_flatten.utils.errors import UnsupportedArchitectureError


def _kronecker_lstsq(m: torch.Tensor, y: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The joint problem written out: unknowns (α, vec T), one row per token and channel, torch.linalg.lstsq."""
    n, d = m.shape
    # Row (i, c) of the design: α * y[i, c] + sum_j m[i, j] T[j, c].
    design = torch.zeros(n * d, 1 + d * d, dtype=torch.float64)
    design[:, 0] = y.reshape(-1)
    for c in range(d):
        design[c::d, 1 + c :: d] = m  # T[j, c] sits at column 1 + j * d + c
    solution = torch.linalg.lstsq(design, target.reshape(-1, 1)).solution.squeeze(1)
    return solution[1:].reshape(d, d), float(solution[0])


def test_the_closed_form_gain_equals_the_written_out_joint_least_squares():
    generator = torch.Generator().manual_seed(0)
    d = 6
    stats = LinearMapStatistics(d, with_gain=True)
    ms, ys, ls = [], [], []
    for rows in (13, 9):
        m = torch.randn(1, rows, d, generator=generator, dtype=torch.float64)
        y = 3.0 * torch.randn(1, rows, d, generator=generator, dtype=torch.float64)
        target = 0.8 * y + m @ torch.randn(d, d, generator=generator, dtype=torch.float64)
        target = target + 0.1 * torch.randn(target.shape, generator=generator, dtype=torch.float64)
        mask = torch.ones(1, rows)
        mask[0, -2:] = 0  # padding: never enters the statistics
        stats.update(m, target - y, mask, stream=y)
        keep = mask.bool()
        ms.append(m[keep])
        ys.append(y[keep])
        ls.append(target[keep])
    transform, gain, _ = solve_least_squares_with_gain(stats)
    expected_t, expected_gain = _kronecker_lstsq(torch.cat(ms), torch.cat(ys), torch.cat(ls))
    assert gain == pytest.approx(expected_gain, rel=1e-10)
    torch.testing.assert_close(transform, expected_t, atol=1e-10, rtol=1e-9)
    # The gain is a real degree of freedom: it fits at least as well as the map alone, here strictly better.
    alone, _ = solve_least_squares(stats)
    m, y, target = torch.cat(ms), torch.cat(ys), torch.cat(ls)
    assert ((gain * y + m @ transform - target) ** 2).sum() < ((y + m @ alone - target) ** 2).sum()


def test_an_exact_gain_and_map_are_recovered():
    generator = torch.Generator().manual_seed(1)
    d = 5
    m = torch.randn(1, 40, d, generator=generator, dtype=torch.float64)
    y = torch.randn(1, 40, d, generator=generator, dtype=torch.float64)
    true_t = torch.randn(d, d, generator=generator, dtype=torch.float64)
    stats = LinearMapStatistics(d, with_gain=True)
    stats.update(m, 1.7 * y + m @ true_t - y, stream=y)
    transform, gain, _ = solve_least_squares_with_gain(stats)
    assert gain == pytest.approx(1.7, rel=1e-12)
    torch.testing.assert_close(transform, true_t, atol=1e-10, rtol=1e-10)


def _negligible_norm_eps(model) -> None:
    """The fold of α upstream is exact up to the norms' ε; make ε negligible so the comparison is tight (in the
    config too: the shallower reference is rebuilt from it)."""
    model.config.rms_norm_eps = 1e-12
    for module in model.modules():
        for name in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-12)


def _naive_joint_fit(original, batches, last_kept: int, end: int) -> tuple[torch.Tensor, float]:
    """(T, α) from full forwards of the dense model, solved written out (`_kronecker_lstsq`)."""
    return _kronecker_lstsq(*naive_fit_rows(original, batches, last_kept, end))


@pytest.mark.parametrize("tied", [False, True])
def test_replaceme_with_gain_equals_the_naive_joint_fit_applied_by_hooks(tied):
    model = tiny_models.FACTORIES["llama_gqa"]()
    if tied:  # the embedding is also the LM head: the final norm must absorb α, and the tie stays
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    _negligible_norm_eps(model)
    original = copy.deepcopy(model)
    config = tiny_config("replaceme", num_layers_to_remove=2, tokens="all", estimator="lstsq_gain")
    quantizer = compress(model, config)
    ((start, end),) = quantizer.report["blocks"]
    assert end < 6, "the block must end inside the stack for hidden_states[end] to be its output"
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    transform, gain = _naive_joint_fit(original, batches, start - 1, end)
    (entry,) = quantizer.report["replaceme"]["maps"]
    assert entry["gain"] == pytest.approx(gain, rel=1e-6)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied

    # The naive, unfolded form: the dense model without the block, whose layer start-1 outputs α Y + M T.
    reference = shallower_reference(original, [i for i in range(6) if not start <= i < end])
    layer = reference.model.layers[start - 1]
    seen = {}
    layer.post_attention_layernorm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("y", args[0]))
    layer.mlp.register_forward_hook(lambda _m, _a, out: seen.__setitem__("m", out))

    def replace_output(_module, _args, output):
        new = gain * seen["y"] + seen["m"] @ transform.float()
        return (new, *output[1:]) if isinstance(output, tuple) else new

    layer.register_forward_hook(replace_output)
    ids = sample_ids(batch=2, length=16, seed=5)
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_gain_lowers_the_calibration_fit_and_reloads_with_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_models.FACTORIES["qwen2"]()
    plain = copy.deepcopy(model)
    with_gain = compress(model, tiny_config("replaceme", num_layers_to_remove=2, estimator="lstsq_gain"))
    compress(plain, tiny_config("replaceme", num_layers_to_remove=2))
    assert with_gain.report["replaceme"]["maps"][0]["gain"] != 1.0
    with_gain.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_hidden_layers == 4
    ids = sample_ids(batch=2, length=16, seed=3)
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))
    assert not torch.allclose(logits(model, ids), logits(plain, ids), atol=1e-3)


def test_gain_requests_that_cannot_be_met_are_refused_before_any_weight_changes():
    assert BridgeOptions("lstsq_gain").stream_gain and not BridgeOptions("lstsq").stream_gain
    with pytest.raises(ValueError, match=r"unknown linear-replacement estimator 'lstsq_gian'.*lstsq_gain"):
        tiny_config("replaceme", num_layers_to_remove=2, estimator="lstsq_gian")
    # ViT writes its stream with patch embeddings: there is no table to fold the gain into.
    vit = tiny_models.FACTORIES["vit"]()
    before = copy.deepcopy(vit.state_dict())
    with pytest.raises(UnsupportedArchitectureError, match="embedding tables"):
        compress(vit, tiny_config("replaceme", num_layers_to_remove=2, estimator="lstsq_gain"))
    for key, value in vit.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_linear_replacement_with_gain_bridges_another_method_exactly_as_replaceme_does():
    """uidl + linear_replacement="lstsq_gain" on replaceme's block folds the same gain and map as replaceme."""
    a, b = tiny_models.FACTORIES["qwen2"](), tiny_models.FACTORIES["qwen2"]()
    via_replaceme = compress(a, tiny_config("replaceme", num_layers_to_remove=2, estimator="lstsq_gain"))
    via_bridge = compress(b, tiny_config("uidl", num_layers_to_remove=2, linear_replacement="lstsq_gain"))
    assert via_replaceme.report["blocks"] == via_bridge.report["blocks"], "uidl chose a block at layer 0 here"
    gains = [m["gain"] for m in via_bridge.report["linear_replacement"]["maps"]]
    assert gains == pytest.approx([m["gain"] for m in via_replaceme.report["replaceme"]["maps"]], rel=1e-12)
    ids = sample_ids(batch=2, length=16, seed=2)
    torch.testing.assert_close(logits(a, ids), logits(b, ids), atol=1e-6, rtol=1e-6)
