"""Imports point one way: each part of the package imports only the parts below it (static, over every module).

Layers, lowest first (a module may import its own layer and those below):
  utils, ops  <  plan, report, roofline  <  the registry of methods (registry.py at the package root, a plugin table)
  <  options (the torch-free declarations of what can be asked)  <  config, bundled  <  calibration  <  adapters
  <  corrections (linear bridges and compensation, applied at a cut on top of any method)  <  compression (what every
  method builds on: the method protocol and its context, the memory and arithmetic vocabulary, the pipeline that runs
  a method with its corrections)  <  methods  <  recovery  <  evaluation  <  export  <  the LayerCollapse package
  (methods/layer_collapse/, which writes its own checkpoints with the generic export)  <  quantizer  <  integration
  <  estimate  <  cli, package root (and `python -m optimum_flatten`). Only the command line imports the estimator
(`test_only_the_cli_imports_the_estimator`), and nothing but the plugin list and the command line imports the
LayerCollapse package (`test_nothing_outside_it_imports_the_layer_collapse_package`): export, recovery, adapters and
the quantizer reach it through the method registry and the method hooks only.
The method registry loads the built-in methods lazily by module name (plugin discovery, like transformers' auto
mappings), so it imports nothing above it; the upward imports listed by name below are the only exceptions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "optimum_flatten"

LAYERS = [
    {"utils", "ops"},
    {"plan", "report", "roofline"},
    {"registry"},
    {"options"},
    {"config", "bundled"},
    {"calibration"},
    {"adapters"},
    {"corrections"},
    {"compression"},
    {"methods"},
    {"recovery"},
    {"evaluation"},
    {"export"},
    {"methods.layer_collapse"},
    {"quantizer"},
    {"integration"},
    {"estimate"},
    {"cli", "__init__", "__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
#: (importing module, imported part): lazy imports that go up on purpose.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
#: The packages of methods that sit in their own layer (above the generic export they write checkpoints with).
METHOD_PACKAGES = {"layer_collapse"}


def _part(parts: list[str]) -> str:
    """The layer a module path belongs to (each method package is its own layer)."""
    if parts[:1] == ["methods"] and len(parts) > 1 and parts[1] in METHOD_PACKAGES:
        return f"methods.{parts[1]}"
    return parts[0] if parts else "__init__"


def _is_module(parts: list[str]) -> bool:
    """Whether `parts` name a module or package of this source tree (``from ..methods import sleb`` names one)."""
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, int]]:
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [[*target, alias.name] for alias in node.names]
            names = [name if not node.module or _is_module(name) else target for name in names]
            found += [(_part(t) if t else "__init__", node.lineno) for t in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optimum_flatten."):
            found.append((_part(node.module.split(".")[1:]), node.lineno))
        elif isinstance(node, ast.Import):
            modules = [alias.name.split(".")[1:] for alias in node.names if alias.name.startswith("optimum_flatten.")]
            found += [(_part(module), node.lineno) for module in modules]
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        source = "__init__" if parts == ["__init__"] else _part(parts)
        for target, line in _imports(path):
            if target not in RANK or source not in RANK:
                problems.append(f"{rel}:{line} imports {target!r}, which has no layer in LAYERS")
            elif RANK[target] > RANK[source] and (str(rel), target) not in ALLOWED_UPWARD:
                problems.append(f"{rel}:{line} ({source}) imports {target}, which sits above it")
    return problems


def test_every_import_points_down_the_layers():
    assert _violations() == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "optimum_flatten"
    (fake / "adapters").mkdir(parents=True)
    (fake / "adapters" / "bad.py").write_text("from ..quantizer import FlattenQuantizer\n")
    (fake / "quantizer.py").write_text("from .adapters import bad\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert _violations() == ["adapters/bad.py:1 (adapters) imports quantizer, which sits above it"]


def test_the_checker_sees_the_export_importing_a_method_package(tmp_path, monkeypatch):
    """Both spellings: the package's module by path, and the package as a name imported from ``methods``."""
    fake = tmp_path / "optimum_flatten"
    (fake / "export").mkdir(parents=True)
    (fake / "methods" / "layer_collapse").mkdir(parents=True)
    (fake / "methods" / "layer_collapse" / "__init__.py").write_text("")
    (fake / "export" / "bad.py").write_text(
        "from ..methods.layer_collapse import save_layer_collapse\nfrom ..methods import layer_collapse\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert _violations() == [
        "export/bad.py:1 (export) imports methods.layer_collapse, which sits above it",
        "export/bad.py:2 (export) imports methods.layer_collapse, which sits above it",
    ]


def test_nothing_outside_it_imports_the_layer_collapse_package():
    """Export, recovery, adapters and the quantizer ask the method registry and its hooks (the checkpoint writer,
    the adoption of a reloaded model) instead of naming the package; only the plugin list and the CLI import it."""
    package = ROOT / "methods" / "layer_collapse"
    importers = {
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if package not in path.parents and any(target == "methods.layer_collapse" for target, _ in _imports(path))
    }
    assert importers <= {"methods/__init__.py", "cli/main.py", "cli/options.py", "cli/layer_collapse.py"}, importers


def test_ops_holds_no_module_classes():
    """ops/ is pure tensor maths: an nn.Module (or Parameter) subclass belongs to the method that uses it."""
    found = []
    for path in sorted((ROOT / "ops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base) for base in node.bases]
                if any(base.split(".")[-1] in {"Module", "Parameter"} for base in bases):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(bases)})")
    assert found == []


def test_only_the_cli_imports_the_estimator():
    """The estimator reads config, adapters and methods; nothing but the command line may depend on it."""
    importers = {
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if any(target == "estimate" for target, _ in _imports(path)) and path.relative_to(ROOT).parts[0] != "estimate"
    }
    assert importers <= {"cli/main.py"}, importers


@pytest.mark.parametrize(
    "module",
    [
        "utils",
        "ops",
        "config",
        "calibration",
        "adapters",
        "corrections",
        "compression",
        "methods",
        "methods.layer_collapse",
        "evaluation",
        "export",
        "quantizer",
        "estimate",
        "cli.main",
    ],
)
def test_each_part_imports_alone_in_a_fresh_interpreter(module):
    """No part depends on another having been imported first (what an import circle breaks)."""
    completed = subprocess.run(
        [sys.executable, "-c", f"import optimum_flatten.{module}"], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-2000:]


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "baichuan", "gpt2", "marian"])
def test_every_adapter_is_what_the_calibration_layer_types_it_as(factory):
    """The calibration layer cannot import the adapters (they sit above it), so it types them by a protocol of the
    members it calls; every adapter must satisfy it (bert and vit share the base class these exercise)."""
    import tiny_models
    from optimum_flatten import get_adapter
    from optimum_flatten.adapters.base import ArchitectureAdapter
    from optimum_flatten.calibration.model_access import CalibrationAdapter

    adapter = get_adapter(tiny_models.FACTORIES[factory]())
    assert isinstance(adapter, ArchitectureAdapter) and isinstance(adapter, CalibrationAdapter)
    assert not isinstance(object(), CalibrationAdapter)  # the check has teeth
