"""Method lifecycle hooks: drivers, the exporter and the card ask the method classes instead of naming methods.

As transformers' quantizers declare what they support, a method declares `supports_compress_on_load`,
`stacks_to_compress`, `checkpoint_writer`, `checkpoint_files` and `card_section`; and what a method reports is added
to the core report without ever replacing a core entry.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tiny_models
from common import compress, tiny_config
from optimum_flatten import FlattenConfig
from optimum_flatten.adapters import get_adapter
from optimum_flatten.cli.main import report_warnings
from optimum_flatten.compression.method import CardSection, CheckpointWriter, CompressionMethod, LayerMatrixFigure
from optimum_flatten.export.checkpoint import (
    REPORT_NAME,
    is_checkpoint_file,
    method_checkpoint_writer,
    save_compressed,
)
from optimum_flatten.export.model_card import describe_parameters, method_sections, render_model_card
from optimum_flatten.integration import FlattenHfQuantizer
from optimum_flatten.methods.ffn_merge import FfnMergeConfig, FfnMergeMethod
from optimum_flatten.methods.layer_collapse import (
    LayerCollapseMethod,
    prepare_layer_collapse_,
    write_layer_collapse_model,
)
from optimum_flatten.methods.shortgpt import ShortGPTMethod
from optimum_flatten.methods.sleb import SLEBMethod
from optimum_flatten.quantizer import FlattenQuantizer
from optimum_flatten.registry import get_method_class, registered_methods
from optimum_flatten.report import CompressionReport, core_fields
from optimum_flatten.utils.errors import InvalidTargetError

SRC = Path(__file__).resolve().parents[1] / "src" / "optimum_flatten"


# ------------------------------------------------------------------------------------- no driver names a method
def _driver_modules() -> list[Path]:
    """The orchestrator, compress-on-load, the memory estimate and the generic exporter (every module of export/: a
    method's own export code lives in the method's package, as LayerCollapse's does)."""
    drivers = [SRC / "quantizer.py", SRC / "integration.py", *sorted((SRC / "estimate").glob("*.py"))]
    return [*drivers, *sorted((SRC / "export").glob("*.py"))]


def _method_mentions(text: str, names: list[str]) -> list[str]:
    """The method names `text` holds as a name: the whole string, an identifier-like name (``ffn_merge``) as a
    word, or any name quoted (```sleb```, ``'auto'``); a plain English word such as "auto" in prose is not one."""
    found = []
    for name in names:
        quoted = re.search(rf"[`'\"]{re.escape(name)}[`'\"]", text)
        identifier = "_" in name and re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)
        if text == name or quoted or identifier:
            found.append(name)
    return found


def test_no_driver_exporter_or_card_names_a_registered_method():
    names = registered_methods()
    assert {"layer_collapse", "ffn_merge"} <= set(names)  # the scan would be vacuous without the methods it guards
    modules = _driver_modules()
    assert {p.name for p in modules} >= {"quantizer.py", "integration.py", "checkpoint.py", "model_card.py"}
    found = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{path.relative_to(SRC)}:{node.lineno} {n}" for n in _method_mentions(node.value, names)]
    assert found == []


def _method_report_keys() -> set[str]:
    """The report entries methods write (``context.report["key"] = ...`` and ``context.report.update({...})``),
    less the core fields, the plan's ``groups`` and the corrections' entries (FlattenConfig options every method
    takes, folded by the pipeline, not by a method)."""
    from optimum_flatten.report import core_fields

    keys: set[str] = set()
    for path in (SRC / "methods").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "report"
            ):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    keys.add(node.slice.value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                if isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "report":
                    for arg in node.args:
                        if isinstance(arg, ast.Dict):
                            keys |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
    return keys - set(core_fields()) - {"groups", "linear_replacement", "compensation"}


def test_no_driver_exporter_card_or_cli_reads_a_methods_report_entry():
    """What a method reports reaches the card, the saved figures, the CLI's warnings and the comparison plot through
    its `card_section`, so the readers hold none of its keys (a new method's entries need no change there)."""
    keys = _method_report_keys()
    assert {"similarity", "calibration_loss", "ffn_groups", "sleb_steps"} <= keys  # the scan sees what it guards
    readers = [*_driver_modules(), SRC / "cli" / "main.py", SRC / "evaluation" / "compare.py"]
    found = []
    for path in readers:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value}")
    assert found == []


def _method_imports(tree: ast.AST, names: list[str]) -> list[str]:
    """Imports of a method's own module within this package (``from .layer_collapse import ...``,
    ``from ..methods import sleb``); other packages' modules (``transformers.quantizers.auto``) are not ours."""
    owned = re.compile(rf"({'|'.join(map(re.escape, names))})(_\w+)?")
    found = []
    for node in ast.walk(tree):
        ours = isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("optimum_flatten"))
        if ours:
            parts = (node.module or "").split(".") + [alias.name for alias in node.names]
            found += [f"{node.lineno} {part}" for part in parts if owned.fullmatch(part)]
    return found


def test_no_driver_exporter_or_card_imports_a_methods_own_module():
    names = registered_methods()
    found = []
    for path in _driver_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(SRC)}:{hit}" for hit in _method_imports(tree, names)]
    assert found == []
    old_branch = "from .layer_collapse import layer_collapse_states\nfrom ..methods.registry import get_method_class\n"
    assert _method_imports(ast.parse(old_branch), names) == ["1 layer_collapse", "1 layer_collapse_states"]


def test_the_scan_recognises_a_method_name():
    """The check above can fail: a literal, a quoted name and an identifier-like name in a message are found."""
    names = ["ffn_merge", "auto"]
    assert _method_mentions("ffn_merge", names) == ["ffn_merge"]
    assert _method_mentions("pass one of them (ffn_merge also takes ...)", names) == ["ffn_merge"]
    assert _method_mentions("method 'auto' cannot", names) == ["auto"]
    assert _method_mentions("auto_map, AutoModel and the auto format", names) == []


# ---------------------------------------------------------------------------------- supports_compress_on_load
def test_every_method_declares_the_flag_at_class_level_with_a_reason_when_it_refuses():
    for name in registered_methods():
        method_class = get_method_class(name)
        assert isinstance(method_class.__dict__.get("supports_compress_on_load", True), bool), name
        assert isinstance(method_class.supports_compress_on_load, bool), name
        if not method_class.supports_compress_on_load:
            assert method_class.compress_on_load_refusal, f"{name} refuses compress-on-load without saying why"
    assert LayerCollapseMethod.supports_compress_on_load is False and CompressionMethod.supports_compress_on_load


def _on_load(method: str, **options: Any) -> FlattenHfQuantizer:
    return FlattenHfQuantizer(FlattenConfig(method=method, **options), pre_quantized=False)


def test_compress_on_load_asks_the_method_class(monkeypatch):
    """The refusal follows the flag, whatever the method's name, with the method's own reason."""
    _on_load("sleb", num_layers_to_remove=1).validate_environment()
    monkeypatch.setattr(SLEBMethod, "supports_compress_on_load", False)
    monkeypatch.setattr(SLEBMethod, "compress_on_load_refusal", "it needs a step between loading and compressing.")
    with pytest.raises(ValueError, match=r"^method 'sleb' cannot run inside from_pretrained: it needs a step"):
        _on_load("sleb", num_layers_to_remove=1).validate_environment()
    monkeypatch.setattr(LayerCollapseMethod, "supports_compress_on_load", True)
    _on_load("layer_collapse", measure_error=False).validate_environment()


def test_layer_collapse_refusal_keeps_its_message():
    with pytest.raises(ValueError, match=r"^method 'layer_collapse' cannot run inside from_pretrained: it collapses"):
        _on_load("layer_collapse", measure_error=False).validate_environment()


# ---------------------------------------------------------------------------------------- stacks_to_compress
@pytest.fixture(scope="module")
def marian_adapter():
    return get_adapter(tiny_models.tiny_marian())


def test_default_compresses_one_stack_and_names_the_methods_that_take_several(marian_adapter):
    method = ShortGPTMethod(get_method_class("shortgpt").config_class())
    assert method.stacks_to_compress(marian_adapter, ["encoder"]) == ["encoder"]
    with pytest.raises(ValueError, match=r"one stack at a time.*\(ffn_merge also takes sync_stacks=True"):
        method.stacks_to_compress(marian_adapter, ["encoder", "decoder"])


def test_ffn_merge_with_sync_stacks_takes_every_stack(marian_adapter):
    synced = FfnMergeMethod(FfnMergeConfig(window_size=2, sync_stacks=True))
    assert synced.stacks_to_compress(marian_adapter, ["encoder", "decoder"]) == ["encoder", "decoder"]
    with pytest.raises(ValueError, match=r"'ffn_merge' with sync_stacks=True merges every stack"):
        synced.stacks_to_compress(marian_adapter, ["decoder"])
    single = FfnMergeMethod(FfnMergeConfig(window_size=2))
    assert single.stacks_to_compress(marian_adapter, ["decoder"]) == ["decoder"]


def test_quantizer_plans_on_the_last_stack_the_hook_returns(marian_adapter, monkeypatch):
    method = ShortGPTMethod(get_method_class("shortgpt").config_class())
    monkeypatch.setattr(method, "stacks_to_compress", lambda adapter, requested: ["decoder", "encoder"])
    quantizer = FlattenQuantizer(FlattenConfig(method="shortgpt", num_layers_to_remove=1))
    assert quantizer._stack(marian_adapter, method) == "encoder"
    quantizer.config.stacks = ["nowhere"]
    with pytest.raises(ValueError, match=r"stacks \['nowhere'\] do not exist"):  # checked before the hook
        quantizer._stack(marian_adapter, method)


# ------------------------------------------------------------------------------------ method report namespace
def _core(**overrides: Any) -> dict[str, Any]:
    core = {
        "method": "sleb",
        "method_args": {},
        "model_type": "llama",
        "base_model": "",
        "base_model_on_hub": False,
        "license": None,
        "architecture": "LlamaForCausalLM",
        "plan": {"groups": [[0]]},
        "plan_summary": "1 -> 1",
        "num_layers_before": 1,
        "num_layers_after": 1,
        "parameters_before": 10,
        "parameters_after": 10,
        "calibration": {},
        "timings_seconds": {},
        "cost": {},
        "total_seconds": 0.0,
        "source_fingerprint": "0123abcd",
    }
    return {**core, **overrides}


def test_method_entries_are_added_but_never_replace_core_ones():
    report = CompressionReport(**_core(), method_entries={"sleb_steps": [1]})
    assert report.to_dict() == {**_core(), "sleb_steps": [1]}
    assert list(report) == [*core_fields(), "sleb_steps"]  # the saved JSON's key order
    assert report["plan"] == {"groups": [[0]]} and report["sleb_steps"] == [1] and report.plan_summary == "1 -> 1"
    assert dict(report) == report.to_dict() and {**report} == report.to_dict() and report == report.to_dict()
    assert "sleb_steps" in report and "nothing" not in report and report.get("nothing") is None
    with pytest.raises(KeyError):
        report["nothing"]
    with pytest.raises(RuntimeError, match=r"method 'sleb' reported \['plan'\], which the core report owns"):
        CompressionReport(**_core(), method_entries={"plan": {"groups": []}, "sleb_steps": []})


def test_compress_returns_a_typed_report_that_json_round_trips():
    quantizer = compress(tiny_models.tiny_llama_mha(), "shortgpt", num_layers_to_remove=1)
    report = quantizer.report
    assert isinstance(report, CompressionReport)
    assert report.num_layers_before - report.num_layers_after == 1 and "block_influence" in report.method_entries
    assert json.loads(json.dumps(report.to_dict())) == report.to_dict()


def test_preflight_refuses_before_any_weight_changes_and_resolves_the_run():
    model = tiny_models.tiny_llama_mha()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantizer = FlattenQuantizer(tiny_config("shortgpt", num_layers_to_remove=1), progress=False)
    checked = quantizer.preflight(model, tiny_models.CharTokenizer())
    assert (checked.stack, checked.num_to_remove, checked.num_layers) == ("decoder", 1, model.config.num_hidden_layers)
    assert len(checked.batches) >= 1
    quantizer.config.num_layers_to_remove = model.config.num_hidden_layers
    with pytest.raises(InvalidTargetError):
        quantizer.preflight(model, tiny_models.CharTokenizer())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_compress_refuses_a_method_report_that_would_overwrite_the_plan(monkeypatch):
    import optimum_flatten.compression.pipeline as pipeline_module

    original = pipeline_module.plan_and_apply_

    def overwriting(adapter, method, context, num_to_remove, corrections):
        plan = original(adapter, method, context, num_to_remove, corrections)
        context.report["plan"] = {"groups": "not what was done"}
        return plan

    monkeypatch.setattr(pipeline_module, "plan_and_apply_", overwriting)
    with pytest.raises(RuntimeError, match=r"reported \['plan'\], which the core report owns"):
        compress(tiny_models.tiny_llama_mha(), "shortgpt", num_layers_to_remove=1)


# ------------------------------------------------------------------------------------------ checkpoint_writer
def _fake_writer(model: nn.Module, directory: Path, **save_kwargs: Any) -> str:
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return "fake_format"


def test_layer_collapse_claims_only_a_model_with_its_mlps():
    model = tiny_models.tiny_gpt2()
    assert method_checkpoint_writer(model) is None
    prepare_layer_collapse_(model, num_mlps=2)
    claim = method_checkpoint_writer(model)
    assert claim == LayerCollapseMethod.checkpoint_writer(model)
    linearisable = claim.report["mlp_layout"][get_adapter(model).stacks()[0]]["linearisable"]
    assert len(linearisable) == 2 and claim.report["mlp_layout"][get_adapter(model).stacks()[0]]["collapsed"] == []
    assert claim.function is write_layer_collapse_model  # the package's own writer, no dotted name


def test_save_uses_the_writer_a_method_names_with_its_report_entries(tmp_path, monkeypatch):
    writer = CheckpointWriter(function=_fake_writer, report={"fake_layout": [1, 2]})
    monkeypatch.setattr(SLEBMethod, "checkpoint_writer", classmethod(lambda cls, model: writer))
    path = save_compressed(tiny_models.tiny_llama_mha(), tmp_path / "out", report={"method": "shortgpt"})
    report = json.loads((path / REPORT_NAME).read_text())
    assert report["export_format"] == "fake_format" and report["fake_layout"] == [1, 2]
    assert "load_with" not in report and (path / "config.json").is_file()


def test_two_methods_claiming_one_model_is_refused(monkeypatch):
    writer = CheckpointWriter(function=_fake_writer)
    for method_class in (SLEBMethod, ShortGPTMethod):
        monkeypatch.setattr(method_class, "checkpoint_writer", classmethod(lambda cls, model: writer))
    with pytest.raises(RuntimeError, match=r"methods \['shortgpt', 'sleb'\] each need their own checkpoint writer"):
        method_checkpoint_writer(tiny_models.tiny_llama_mha())


def test_checkpoint_files_of_methods_are_part_of_the_checkpoint(monkeypatch):
    assert is_checkpoint_file("modeling_layer_collapse_gpt2.py")
    assert not is_checkpoint_file("modeling_fake_gpt2.py")
    monkeypatch.setattr(SLEBMethod, "checkpoint_files", ("modeling_fake_*.py",))
    assert is_checkpoint_file("modeling_fake_gpt2.py")


# ------------------------------------------------------------------------------------------------ card_section
def test_card_takes_summary_lines_and_parameters_from_a_method_section(monkeypatch):
    section = CardSection(summary="A fake summary.", lines=("- fake line",), parameters="fake parameters")
    monkeypatch.setattr(SLEBMethod, "card_section", classmethod(lambda cls, report: section))
    report = {"method": "shortgpt", "parameters_before": 10, "parameters_after": 8}
    card = render_model_card(report)
    assert "A fake summary." in card and "- fake line" in card and "- Parameters: fake parameters" in card
    assert describe_parameters(report) == "fake parameters"
    assert describe_parameters({"parameters_before": 10}) == "see flatten_report.json"  # counts checked first


def test_a_methods_figure_is_drawn_into_the_checkpoint_and_shown_on_the_card(tmp_path, monkeypatch):
    figure = LayerMatrixFigure(
        file_name="fake_matrix.png", caption="A fake matrix", matrix=[[1.0, 0.5], [None, 1.0]], groups=[[0, 1]]
    )
    section = CardSection(figures=(figure,), warnings=("a fake warning",))
    monkeypatch.setattr(SLEBMethod, "card_section", classmethod(lambda cls, report: section))
    monkeypatch.setattr(SLEBMethod, "checkpoint_files", ("fake_matrix.png",))
    model = tiny_models.tiny_llama_mha()
    quantizer = compress(model, "shortgpt", num_layers_to_remove=1)
    out = quantizer.save(model, tmp_path / "out")
    assert (out / "fake_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![A fake matrix](fake_matrix.png)" in (out / "README.md").read_text()
    assert report_warnings(quantizer.report) == ["a fake warning"]
    assert is_checkpoint_file("fake_matrix.png")


def test_sections_equal_for_sibling_methods_appear_once(monkeypatch):
    section = CardSection(lines=("- shared line",))
    for method_class in (SLEBMethod, ShortGPTMethod):
        monkeypatch.setattr(method_class, "card_section", classmethod(lambda cls, report: section))
    assert render_model_card({"method": "sleb"}).count("- shared line") == 1


def test_card_asks_the_reports_own_method_first(monkeypatch):
    for method_class in (SLEBMethod, ShortGPTMethod):
        own = CardSection(summary=f"{method_class.__name__} summary")
        monkeypatch.setattr(method_class, "card_section", classmethod(lambda cls, report, own=own: own))
    assert [s.summary for s in method_sections({"method": "sleb"})][:2] == [
        "SLEBMethod summary",
        "ShortGPTMethod summary",
    ]
    assert "SLEBMethod summary" in render_model_card({"method": "sleb"})
    assert "ShortGPTMethod summary" in render_model_card({"method": "shortgpt"})


def test_a_plain_report_gets_no_method_section_and_the_generic_card():
    report = {"method": "shortgpt", "num_layers_before": 6, "num_layers_after": 4}
    assert method_sections(report) == []
    assert "with 4 layers instead of 6" in render_model_card(report)


def test_method_sections_come_from_the_entries_each_method_writes():
    ffn = {"ffn_groups": [{"layers": [1, 2], "stack": "decoder"}], "parameters_before": 10, "parameters_after": 8}
    (section,) = method_sections({"method": "shortgpt", **ffn})
    assert "share their feed-forward parameters" in section.summary
    assert section.lines == ("- Feed-forward sublayers shared by layers [1, 2] (decoder)",)
    assert section.parameters.startswith("10 -> 10 in the checkpoint")
    layout = {"mlp_layout": {"h": {"collapsed": [0], "linearisable": [1]}}, "export_format": "remote_code"}
    (section,) = method_sections({"method": "sleb", **layout})
    assert "trust_remote_code=True" in section.summary and section.parameters is None
    assert section.lines == (
        "- h: MLPs collapsed into one linear map in layers [0], learned linearity alpha still in layers [1]",
    )
