"""method="auto": every candidate scored on held-out calibration batches, the best one applied."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny_models
from common import compress, logits, sample_ids, tiny_config
from optimum_flatten import FlattenConfig, get_adapter
from optimum_flatten.calibration.capture import LayerwiseRunner
from optimum_flatten.calibration.data import build_calibration_batches
from optimum_flatten.calibration.states import CalibratedStates, next_token_nll
from optimum_flatten.methods.auto import split_batches
from optimum_flatten.utils.errors import UnknownMethodError, UnsupportedArchitectureError


def _config(**options) -> FlattenConfig:
    return tiny_config("auto", num_layers_to_remove=2, batch_size=2, **options)


def _validation_nll(model, batches) -> float:
    adapter = get_adapter(model)
    states = CalibratedStates(LayerwiseRunner(adapter, batches, "decoder"), adapter.layers("decoder"))
    return next_token_nll(adapter, states.boundary(states.num_layers), batches, "decoder")


def test_auto_applies_the_candidate_with_the_lowest_held_out_loss_and_reports_every_score():
    candidates = "shortgpt uidl+scale replaceme flattengpt+lstsq"
    model = tiny_models.FACTORIES["llama_gqa"]()
    original = copy.deepcopy(model)
    config = _config(candidates=candidates, refit=False)
    quantizer = compress(model, config)
    report = quantizer.report["auto"]
    assert report["split"]["fitting_batches"] == 3 and report["split"]["validation_batches"] == 1
    scores = {c["candidate"]: c["validation_nll"] for c in report["candidates"]}
    assert list(scores) == candidates.split()
    assert report["winner"] == min(scores, key=scores.get)

    # The applied model is what the winner gives when run by itself on the fitting batches, and its held-out loss is
    # the winner's score.
    batches = build_calibration_batches(tiny_models.CharTokenizer(), config.calibration)
    fit, validation = split_batches(batches, 0.25)
    assert _validation_nll(model, validation) == pytest.approx(scores[report["winner"]], abs=1e-5)
    name, _, correction = report["winner"].partition("+")
    extra = {"linear_replacement": correction} if correction in ("lstsq", "cosine") else {}
    extra |= {"compensation": correction} if correction == "scale" else {}
    alone = copy.deepcopy(original)
    # The same fitting tokens: the fitting batches' texts are not recoverable, so run the pipeline on them directly.
    from optimum_flatten.compression.method import MethodContext
    from optimum_flatten.compression.pipeline import Corrections, plan_and_apply_
    from optimum_flatten.registry import get_method_class

    method_class = get_method_class(name)
    plan_and_apply_(
        get_adapter(alone),
        method_class(method_class.config_class()),
        MethodContext(batches=fit, progress=False),
        2,
        Corrections(extra.get("linear_replacement"), extra.get("compensation")),
    )
    ids = sample_ids(batch=2, length=16, seed=9)
    torch.testing.assert_close(logits(model, ids), logits(alone, ids))
    assert quantizer.report["cost"]["stack_passes"] > 0


def test_budget_limits_the_candidates_and_the_choice_is_among_those_scored():
    model = tiny_models.FACTORIES["qwen3"]()
    quantizer = compress(model, _config(candidates="uidl shortgpt replaceme", max_candidates=2))
    scored = [c["candidate"] for c in quantizer.report["auto"]["candidates"]]
    assert scored == ["uidl", "shortgpt"]
    assert quantizer.report["auto"]["winner"] in scored


def test_a_refused_candidate_is_recorded_and_the_others_compete():
    model = tiny_models.FACTORIES["bert"]()
    with pytest.raises(UnsupportedArchitectureError, match="no LM head"):
        compress(model, _config(candidates="shortgpt"))
    gpt2 = tiny_models.FACTORIES["gpt2"]()  # flattengpt needs views GPT-2 has; ffn_merge keeps depth: refused
    quantizer = compress(gpt2, _config(candidates="ffn_merge shortgpt"))
    first, second = quantizer.report["auto"]["candidates"]
    assert "validation_nll" in second
    assert "refused" in first and "keeps every layer" in first["refused"]
    assert quantizer.report["auto"]["winner"] == "shortgpt"


def test_bad_candidates_are_refused_when_the_config_is_made():
    with pytest.raises(UnknownMethodError, match="shortgtp"):
        _config(candidates="shortgtp")
    with pytest.raises(ValueError, match=r"unknown correction 'lsq'.*lstsq"):
        _config(candidates="shortgpt+lsq")
    with pytest.raises(ValueError, match="validation_fraction"):
        _config(validation_fraction=1.0)
    with pytest.raises(ValueError, match=r"candidates lists 'shortgpt' more than once"):
        _config(candidates="shortgpt uidl+scale shortgpt")
    with pytest.raises(ValueError, match="fits its own linear replacement"):
        _config(linear_replacement="lstsq")
    model = tiny_models.FACTORIES["llama_gqa"]()
    with pytest.raises(ValueError, match="at least 2 calibration batches"):
        compress(model, "auto", num_layers_to_remove=2, nsamples=2, batch_size=8)


def test_the_model_card_lists_every_candidate_and_the_winner():
    from optimum_flatten.export.model_card import render_model_card

    model = tiny_models.FACTORIES["llama_gqa"]()
    quantizer = compress(model, _config(candidates="shortgpt uidl+scale replaceme"))
    card = render_model_card(quantizer.report)
    assert f"Chosen automatically: `{quantizer.report['auto']['winner']}`" in card
    for entry in quantizer.report["auto"]["candidates"]:
        assert f"| {entry['candidate']} | {entry['validation_nll']} |" in card
    if "scale" in quantizer.report["auto"]["winner"]:
        assert "Magnitude compensation" in card


def test_refit_runs_the_winner_on_every_calibration_batch():
    model = tiny_models.FACTORIES["qwen3"]()
    original = copy.deepcopy(model)
    quantizer = compress(model, _config(candidates="uidl+scale shortgpt"))
    report = quantizer.report["auto"]
    assert report["refit"]["on"] == "every calibration batch"
    name, _, correction = report["winner"].partition("+")
    options = {"compensation": correction} if correction else {}
    direct = compress(original, name, num_layers_to_remove=2, batch_size=2, **options)
    assert quantizer.plan == direct.plan
    ids = sample_ids(batch=2, length=16, seed=10)
    torch.testing.assert_close(logits(model, ids), logits(original, ids))


def test_candidate_options_are_read_through_the_type_hints_and_reach_the_method():
    from optimum_flatten.methods.auto import AutoConfig

    specs = AutoConfig(
        candidates="replaceme:num_blocks=2,tokens=all+lstsq uidl:tokens=all+scale sleb"
    ).candidate_specs()
    assert [s.label for s in specs] == ["replaceme:num_blocks=2,tokens=all+lstsq", "uidl:tokens=all+scale", "sleb"]
    assert specs[0].options == {"num_blocks": 2, "tokens": "all"} and isinstance(specs[0].options["num_blocks"], int)
    assert specs[0].build().config.num_blocks == 2 and specs[2].build().config == type(specs[2].build().config)()
    for text, message in [
        ("replaceme:num_block=2", r"unknown option 'num_block'.*num_blocks"),
        ("replaceme:num_blocks=two", r"num_blocks='two'"),
        ("uidl:tokens=some", r"tokens='some' is not one of \['last', 'all'\]"),
        ("uidl:tokens", "needs the form key=value"),
    ]:
        with pytest.raises(ValueError, match=message):
            AutoConfig(candidates=text)


def test_a_candidate_with_options_is_scored_and_applied_with_them():
    model = tiny_models.FACTORIES["llama_gqa"]()
    config = _config(candidates="replaceme:num_blocks=2", refit=False)
    quantizer = compress(model, config)
    assert quantizer.report["auto"]["winner"] == "replaceme:num_blocks=2"
    # Two blocks of one layer each, as the option asked, and what was scored is what was applied.
    blocks = quantizer.report["auto"]["winner_report"]["blocks"]
    assert len(blocks) == 2 and all(end - start == 1 for start, end in blocks)


def test_a_family_that_refuses_a_candidate_gets_the_fallbacks_scored_once_after_the_list():
    # Gemma's norms after each sublayer refuse a bridge folded into down_proj: the drops with the diagonal bridge are
    # scored after the listed candidates, and can win.
    model = tiny_models.FACTORIES["gemma3_text"]()
    config = _config(candidates="shortgpt+lstsq_down uidl replaceme", refit=False)
    quantizer = compress(model, config)
    entries = quantizer.report["auto"]["candidates"]
    labels = [e["candidate"] for e in entries]
    assert labels == [
        "shortgpt+lstsq_down",
        "uidl",
        "replaceme",
        "sleb:scoring_batches=1+diagonal",
        "shortgpt+diagonal",
    ]
    assert entries[0]["refused_by"] == "architecture" and "down_proj" in entries[0]["refused"]
    assert all("validation_nll" in e for e in entries[3:])
    scores = {e["candidate"]: e["validation_nll"] for e in entries if "validation_nll" in e}
    assert quantizer.report["auto"]["winner"] == min(scores, key=scores.get)


def test_the_fallbacks_wait_for_a_family_that_holds_none_of_the_listed_bridges():
    # A family that refuses nothing never scores them.
    model = tiny_models.FACTORIES["llama_gqa"]()
    quantizer = compress(model, _config(candidates="shortgpt uidl", refit=False))
    assert [e["candidate"] for e in quantizer.report["auto"]["candidates"]] == ["shortgpt", "uidl"]
    # A refusal, but a listed bridge folds (as ReplaceMe's own map does on a mixture of experts): the list stands.
    gemma = tiny_models.FACTORIES["gemma3_text"]()
    quantizer = compress(gemma, _config(candidates="replaceme shortgpt+diagonal", refit=False))
    entries = quantizer.report["auto"]["candidates"]
    assert [e["candidate"] for e in entries] == ["replaceme", "shortgpt+diagonal"]
    assert entries[0]["refused_by"] == "architecture" and "validation_nll" in entries[1]
    # Turned off.
    gemma = tiny_models.FACTORIES["gemma3_text"]()
    quantizer = compress(gemma, _config(candidates="replaceme uidl", fallback_candidates="", refit=False))
    assert [e["candidate"] for e in quantizer.report["auto"]["candidates"]] == ["replaceme", "uidl"]
    # A fallback already listed is not scored twice, and the budget counts the fallbacks.
    gemma = tiny_models.FACTORIES["gemma3_text"]()
    config = _config(candidates="replaceme uidl", fallback_candidates="uidl shortgpt+diagonal sleb", max_candidates=3)
    labels = [e["candidate"] for e in compress(gemma, config).report["auto"]["candidates"]]
    assert labels == ["replaceme", "uidl", "shortgpt+diagonal"]
    with pytest.raises(ValueError, match="unknown correction"):
        _config(fallback_candidates="sleb+diag")


def test_a_winner_that_plans_on_the_first_batches_keeps_its_scored_plan_and_equals_the_method_run_alone():
    # SLEB with scoring_batches=1 plans on the first batch, which fitting and refit share: its search is not run a
    # second time, and the model is the one SLEB with the same options gives by itself (the bridge fitted on every
    # batch, as the refit asks).
    model = tiny_models.FACTORIES["gemma3_text"]()
    alone = copy.deepcopy(model)
    quantizer = compress(model, _config(candidates="sleb:scoring_batches=1+diagonal"))
    refit = quantizer.report["auto"]["refit"]
    assert "not searched again" in refit["plan"] and refit["same_plan_as_scored"]
    assert "refit" not in quantizer.report["timings_seconds"]
    compress(alone, tiny_config("sleb", num_layers_to_remove=2, batch_size=2, scoring_batches=1,
                                linear_replacement="diagonal"))  # fmt: skip
    ids = sample_ids(batch=2, length=16, seed=9)
    torch.testing.assert_close(logits(model, ids), logits(alone, ids), rtol=0, atol=0)
