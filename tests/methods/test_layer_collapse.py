"""LayerCollapse wired as a method: prepare (exact at α = 0), refusals, collapse against naive references, training
with the Trainer, and both export formats reloaded without optimum_flatten."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel, TrainingArguments

import tiny_models
from common import assert_close, compress, logits, reload_with_remote_code, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer, get_adapter
from optimum_flatten.calibration import CalibrationBatch
from optimum_flatten.export.checkpoint import REPORT_NAME
from optimum_flatten.methods.layer_collapse import (
    CollapseAlpha,
    LayerCollapseConfig,
    build_layer_collapse_trainer,
    collapse_prepared_mlps_,
    prepare_layer_collapse_,
    prepared_mlps,
    save_layer_collapse,
)
from optimum_flatten.methods.layer_collapse.training import ALPHA_LOG_PREFIX
from optimum_flatten.utils.errors import InvalidTargetError, NotCollapsibleError, UnsupportedArchitectureError
from optimum_flatten.utils.torch_utils import count_parameters

NUM_LAYERS, HIDDEN, INNER = 6, 32, 48
MODELING_MODULE, REMOTE_MODEL_TYPE = "modeling_layer_collapse_gpt2", "gpt2_layer_collapse"
#: Parameters one collapsed MLP stops holding: c_fc + c_proj (2·d·h + h + d) become one d x d map with bias.
SAVED_PER_MLP = (2 * HIDDEN * INNER + INNER + HIDDEN) - (HIDDEN * HIDDEN + HIDDEN)


def _compress(model, **options) -> FlattenQuantizer:
    """LayerCollapse calibrated on 4 samples of 16 tokens."""
    return compress(model, "layer_collapse", nsamples=4, seqlen=16, **options)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before: dict[str, torch.Tensor], module_types: list[str]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert [type(m).__name__ for m in model.modules()] == module_types


def _set_alphas(model, value: float) -> None:
    with torch.no_grad():
        for activation in prepared_mlps(get_adapter(model), "decoder").values():
            activation.alpha.fill_(value)


def _linearised(num_mlps: int, alpha: float = 1.0):
    model = tiny_models.tiny_gpt2()
    prepare_layer_collapse_(model, num_mlps=num_mlps)
    _set_alphas(model, alpha)
    return model


# --------------------------------------------------------------------------------------------------- prepare
def test_prepare_leaves_logits_unchanged_and_returns_the_last_mlps():
    """α = 0 is the pretrained activation bit for bit; the selection counts from the last block downwards."""
    model = tiny_models.tiny_gpt2()
    ids = sample_ids()
    reference = logits(model, ids)
    activations = prepare_layer_collapse_(model, num_mlps=2)
    assert list(activations) == [4, 5]
    assert all(isinstance(a.alpha, CollapseAlpha) and float(a.alpha.detach()) == 0.0 for a in activations.values())
    assert model.transformer.h[5].mlp.act is activations[5]
    assert torch.equal(logits(model, ids), reference)
    # mlp_fraction rounds to whole blocks; already prepared MLPs keep their module (and α).
    again = prepare_layer_collapse_(model, LayerCollapseConfig(mlp_fraction=0.5))
    assert list(again) == [3, 4, 5] and again[5] is activations[5]
    assert torch.equal(logits(model, ids), reference)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2"])
def test_prepare_refuses_gated_mlps_and_changes_nothing(factory):
    model = tiny_models.FACTORIES[factory]()
    before, types = _state(model), [type(m).__name__ for m in model.modules()]
    with pytest.raises(UnsupportedArchitectureError, match="bilinear"):
        prepare_layer_collapse_(model, num_mlps=2)
    _assert_unchanged(model, before, types)


@pytest.mark.parametrize(
    ("options", "message"),
    [({}, "num_mlps=k"), ({"num_mlps": 7}, "at most 6"), ({"num_mlps": 1, "mlp_fraction": 0.5}, "at most one")],
)
def test_prepare_refuses_a_bad_selection(options, message):
    model = tiny_models.tiny_gpt2()
    with pytest.raises(ValueError, match=message):
        prepare_layer_collapse_(model, **options)
    assert not prepared_mlps(get_adapter(model), "decoder")


def test_the_selection_walks_down_the_stack_past_collapsed_mlps():
    """One MLP at a time from the last down, as in the paper: num_mlps counts MLPs not collapsed yet."""
    model = _linearised(1)
    _compress(model)  # layer 5 collapsed
    assert list(prepare_layer_collapse_(model, num_mlps=1)) == [4]
    assert list(prepare_layer_collapse_(model, num_mlps=2)) == [3, 4]  # layer 4 keeps its module and alpha
    with pytest.raises(ValueError, match=r"6 blocks, 1 of them already collapsed; choose at most 5"):
        prepare_layer_collapse_(model, num_mlps=6)
    assert sorted(prepared_mlps(get_adapter(model), "decoder")) == [3, 4]


# -------------------------------------------------------------------------------------------------- collapse
@pytest.mark.parametrize("num_mlps", [NUM_LAYERS, 2], ids=["all", "partly"])
def test_collapse_at_alpha_one_equals_the_linearised_model(num_mlps):
    """α = 1 set by hand: the collapsed model computes what the two-map linear MLPs computed, and each collapsed map
    is the naive product of the original Conv1D weights (float64 reference)."""
    original = tiny_models.tiny_gpt2()
    model = _linearised(num_mlps)
    ids = sample_ids()
    linearised = logits(model, ids)
    assert not torch.allclose(linearised, logits(original, ids), atol=1e-3)  # the linearisation is no no-op
    parameters = count_parameters(original)
    quantizer = _compress(model)
    assert_close(logits(model, ids), linearised)
    assert count_parameters(model) == parameters - num_mlps * SAVED_PER_MLP
    collapsed = list(range(NUM_LAYERS - num_mlps, NUM_LAYERS))
    report = quantizer.report["layer_collapse"]
    assert report["collapsed_layers"] == collapsed
    assert [r["layer"] for r in report["collapsed"]] == collapsed
    assert all(r["error_bound"] == 0.0 and r["relative_error"] < 1e-12 for r in report["collapsed"])
    assert quantizer.plan.group_lists() == [[i] for i in range(NUM_LAYERS)]
    for i in collapsed:
        before, after = original.transformer.h[i].mlp, model.transformer.h[i].mlp
        w_fc, w_proj = before.c_fc.weight.double(), before.c_proj.weight.double()  # stored (in, out)
        assert isinstance(after.c_proj, nn.Identity) and isinstance(after.act, nn.Identity)
        assert_close(after.c_fc.weight.double(), w_fc @ w_proj, torch.float32)
        assert_close(
            after.c_fc.bias.double(),
            before.c_fc.bias.double() @ w_proj + before.c_proj.bias.double(),
            torch.float32,
        )
    for i in range(NUM_LAYERS - num_mlps):
        assert torch.equal(model.transformer.h[i].mlp.c_fc.weight, original.transformer.h[i].mlp.c_fc.weight)


def test_collapse_just_below_threshold_reports_a_bound_above_the_measured_error():
    model = _linearised(2, alpha=1.0 - 5e-5)
    ids = sample_ids()
    linearised = logits(model, ids)
    records = _compress(model).report["layer_collapse"]["collapsed"]
    for record in records:
        assert 0.0 < record["error"] <= record["error_bound"]
        assert record["relative_error"] < 1e-4
    torch.testing.assert_close(logits(model, ids), linearised, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("through_quantizer", [True, False], ids=["quantizer", "function"])
def test_collapse_above_threshold_raises_with_alpha_and_changes_nothing(through_quantizer):
    model = _linearised(2)
    with torch.no_grad():
        model.transformer.h[4].mlp.act.alpha.fill_(0.625)
    before, types = _state(model), [type(m).__name__ for m in model.modules()]
    with pytest.raises(NotCollapsibleError, match=r"layer 4: alpha = 0\.625"):
        if through_quantizer:
            _compress(model)
        else:
            collapse_prepared_mlps_(model)
    _assert_unchanged(model, before, types)


def test_collapse_function_without_quantizer_and_with_calibration():
    model = _linearised(2)
    ids = sample_ids()
    linearised = logits(model, ids)
    batches = [CalibrationBatch(sample_ids(2, 16, seed=3), torch.ones(2, 16, dtype=torch.long))]
    records = collapse_prepared_mlps_(model, batches=batches)
    assert [r["layer"] for r in records] == [4, 5] and all(r["tokens"] == 32 for r in records)
    assert_close(logits(model, ids), linearised)
    get_adapter(model).validate()


def test_collapse_step_refusals():
    with pytest.raises(InvalidTargetError, match="keeps every layer"):
        FlattenConfig(method="layer_collapse", num_layers_to_remove=1)
    with pytest.raises(ValueError, match="no MLP of this model is prepared"):
        _compress(tiny_models.tiny_gpt2())
    model = _linearised(2)
    before, types = _state(model), [type(m).__name__ for m in model.modules()]
    with pytest.raises(ValueError, match=r"the prepared ones are \[4, 5\]"):
        _compress(model, num_mlps=3)
    _assert_unchanged(model, before, types)


# -------------------------------------------------------------------------------------------------- training
def _rows(num: int = 8, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = sample_ids(num, length, seed=5)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _arguments(tmp_path, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def test_training_with_the_regularizer_moves_alpha_towards_one_and_logs_it(tmp_path):
    model = tiny_models.tiny_gpt2()
    prepare_layer_collapse_(model, num_mlps=2)
    trainer = build_layer_collapse_trainer(model, _rows(), _arguments(tmp_path), lc=100.0)
    trainer.train()
    alphas = {i: float(a.alpha.detach()) for i, a in prepared_mlps(get_adapter(model), "decoder").items()}
    assert all(0.02 < a <= 1.0 for a in alphas.values()), alphas
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    keys = {f"{ALPHA_LOG_PREFIX}transformer.h.{i}.mlp.act" for i in (4, 5)}
    assert len(logged) == 4 and all(keys <= entry.keys() for entry in logged)
    first, last = logged[0], logged[-1]
    assert all(last[k] > first[k] for k in keys)


def test_training_with_adamlc_reaches_the_threshold_then_collapses(tmp_path):
    """With 2·lr·lc ≥ 1 AdamLC's decoupled pull puts α at 1, and Adam's own step moves it by about lr only, so the
    trained model collapses; the collapsed model computes what the trained one did, within the reported error."""
    model = tiny_models.tiny_gpt2()
    prepare_layer_collapse_(model, num_mlps=2)
    arguments = _arguments(tmp_path, learning_rate=1e-6, max_steps=2)
    trainer = build_layer_collapse_trainer(model, _rows(), arguments, lc=1e6, pull="adamlc")
    trainer.train()
    assert all(f"{ALPHA_LOG_PREFIX}transformer.h.4.mlp.act" in e for e in trainer.state.log_history if "loss" in e)
    model.eval()
    ids = sample_ids()
    trained = logits(model, ids)
    quantizer = _compress(model)
    assert all(abs(1 - r["alpha"]) < 1e-4 for r in quantizer.report["layer_collapse"]["collapsed"])
    torch.testing.assert_close(logits(model, ids), trained, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------- export
def test_export_all_collapsed_reloads_as_plain_gpt2(tmp_path):
    model = _linearised(NUM_LAYERS)
    quantizer = _compress(model)
    ids = sample_ids()
    expected = logits(model, ids)
    path = quantizer.save(model, tmp_path / "out")
    assert json.loads((path / REPORT_NAME).read_text())["export_format"] == "stock"
    assert not (path / f"{MODELING_MODULE}.py").exists()
    assert all(isinstance(layer.mlp.c_proj, nn.Identity) for layer in model.transformer.h)  # save restored it
    reloaded = GPT2LMHeadModel.from_pretrained(path).eval()
    assert reloaded.config.n_inner == HIDDEN and reloaded.config.activation_function == "linear"
    assert_close(logits(reloaded, ids), expected)
    get_adapter(reloaded).validate()


def test_export_partly_collapsed_and_linearisable_reload_with_remote_code_only(tmp_path):
    """Partly collapsed (2 of 6) and mid-training (α = 0.3, nothing collapsed) models reload in a fresh interpreter
    through trust_remote_code, with equal logits, equal unique parameter counts and no optimum_flatten import."""
    ids = sample_ids()
    partly = _linearised(2)
    _compress(partly)
    linearisable = _linearised(3, alpha=0.3)
    models = {"partly": partly, "linearisable": linearisable}
    jobs = {}
    for name, model in models.items():
        path = save_layer_collapse(model, tmp_path / name)
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == REMOTE_MODEL_TYPE and "AutoModelForCausalLM" in config["auto_map"]
        assert (path / f"{MODELING_MODULE}.py").exists()
        assert "trust_remote_code=True" in (path / "README.md").read_text()
        jobs[name] = (path, {"input_ids": ids, "use_cache": False}, "logits")
    out = reload_with_remote_code(jobs, tmp_path)
    assert out["imported"] == []
    for name, model in models.items():
        assert out[name]["auto"] == "AutoModelForCausalLM" and out[name]["type"] == "LayerCollapseGPT2LMHeadModel"
        assert out[name]["model_type"] == REMOTE_MODEL_TYPE
        assert out[name]["parameters"] == count_parameters(model)
        assert_close(out[name]["output"], logits(model, ids))
    assert count_parameters(partly) == count_parameters(tiny_models.tiny_gpt2()) - 2 * SAVED_PER_MLP


def test_stock_format_is_refused_for_a_partly_collapsed_model(tmp_path):
    model = _linearised(2)
    _compress(model)
    with pytest.raises(ValueError, match="every MLP of every stack collapsed"):
        save_layer_collapse(model, tmp_path / "out", export_format="stock")
    assert not (tmp_path / "out").exists()


def test_collapse_without_calibration_data_when_not_measuring():
    """measure_error=False needs neither a dataset nor a tokenizer; the record then holds no error figures."""
    model = _linearised(2)
    ids = sample_ids()
    linearised = logits(model, ids)
    quantizer = compress(model, FlattenConfig(method="layer_collapse", measure_error=False), tokenizer=None)
    records = quantizer.report["layer_collapse"]["collapsed"]
    assert [r["layer"] for r in records] == [4, 5] and all("error" not in r for r in records)
    assert_close(logits(model, ids), linearised)


@pytest.mark.parametrize(
    ("method", "options", "what"),
    [
        ("flattengpt", {"num_layers_to_remove": 2}, "flattengpt"),
        ("ffn_merge", {}, "ffn_merge"),
        ("replaceme", {"num_layers_to_remove": 1}, "replaceme"),
        ("shortgpt", {"num_layers_to_remove": 1, "linear_replacement": "lstsq"}, "linear_replacement='lstsq'"),
        ("uidl", {"num_layers_to_remove": 1, "compensation": "scale"}, "compensation='scale'"),
    ],
)
def test_methods_reading_the_mlps_projections_refuse_collapsed_mlps_before_any_change(method, options, what):
    """FlattenGPT failed inside its application (an AttributeError on the identity down map), ReplaceMe and the
    corrections at their fold, each with a layer already gone; ffn_merge failed in its plan: all are refused
    first, naming the collapsed layers."""
    model = tiny_models.tiny_gpt2()
    for adapter in prepare_layer_collapse_(model, num_mlps=2).values():
        adapter.alpha.data.fill_(1.0)
    FlattenQuantizer(FlattenConfig(method="layer_collapse", measure_error=False)).compress(model)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = FlattenConfig(method=method, dataset=tiny_models.sample_texts(40), nsamples=8, seqlen=16, **options)
    with pytest.raises(ValueError, match=rf"{re.escape(what)} reads each MLP's .* layers \[4, 5\] are single linear"):
        FlattenQuantizer(config).compress(model, tiny_models.tiny_hf_tokenizer())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_the_cli_collapses_without_a_dataset_when_not_measuring(tmp_path):
    """`compress --method layer_collapse --measure-error false` reads no text, as the API does: it was refused for
    the missing --dataset before loading."""
    from optimum_flatten.cli.main import main

    model = tiny_models.tiny_gpt2()
    for adapter in prepare_layer_collapse_(model, num_mlps=2).values():
        adapter.alpha.data.fill_(1.0)
    save_layer_collapse(model, tmp_path / "prepared", export_format="remote_code")
    tiny_models.tiny_hf_tokenizer().save_pretrained(tmp_path / "prepared")
    argv = ["compress", str(tmp_path / "prepared"), "--method", "layer_collapse", "--measure-error", "false",
            "--trust-remote-code", "--no-progress", "--output", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert [r["layer"] for r in report["layer_collapse"]["collapsed"]] == [4, 5]


def test_alpha_stays_float32_when_a_half_precision_checkpoint_reloads(tmp_path):
    """A bfloat16 model's alpha is trained in float32 (its stop at 1 - 1e-4 is not a bfloat16 value) and saved so:
    reloading the remote code in bfloat16 rounded it (0.6 -> 0.6015625) for a resumed training."""
    from transformers import AutoModelForCausalLM

    model = tiny_models.tiny_gpt2().to(torch.bfloat16)
    for adapter in prepare_layer_collapse_(model, num_mlps=2).values():
        adapter.alpha.data.fill_(0.6)
    save_layer_collapse(model, tmp_path / "partial", export_format="remote_code")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "partial", trust_remote_code=True)
    get_adapter(reloaded)  # adopts the reloaded activations
    alphas = [p for name, p in reloaded.named_parameters() if name.endswith("alpha")]
    assert len(alphas) == 2 and all(a.dtype == torch.float32 and a.item() == torch.tensor(0.6).item() for a in alphas)
    assert reloaded.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16  # the rest keeps the model's dtype
