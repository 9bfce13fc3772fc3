"""Imports point one way: each part of the package imports only the parts below it (static, over every module).

Layers, lowest first (a module may import its own layer and those below):
  utils, ops  <  registry of methods (methods/registry.py, a plugin table)  <  config, bundled  <  calibration
  <  adapters  <  methods  <  recovery  <  evaluation  <  export  <  quantizer  <  integration  <  estimate
  <  cli, package root. Only the command line imports the estimator (`test_only_the_cli_imports_the_estimator`).
The method registry loads the built-in methods lazily (plugin discovery, like transformers' auto mappings); that one
upward import, inside a function, is the only exception and is listed here by name.
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
    {"plan"},
    {"methods.registry"},
    {"config", "bundled"},
    {"calibration"},
    {"adapters"},
    {"methods"},
    {"recovery"},
    {"evaluation"},
    {"export"},
    {"quantizer"},
    {"integration"},
    {"estimate"},
    {"cli", "__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
#: (importing module, imported part): lazy imports that go up on purpose.
ALLOWED_UPWARD = {("methods/registry.py", "methods")}


def _part(parts: list[str]) -> str:
    """The layer a module path belongs to (``methods/registry`` is its own layer)."""
    if parts[:2] == ["methods", "registry"]:
        return "methods.registry"
    return parts[0] if parts else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [[*target, alias.name] for alias in node.names] if not node.module else [target]
            found += [(_part(t) if t else "__init__", node.lineno) for t in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optimum_flatten."):
            found.append((_part(node.module.split(".")[1:]), node.lineno))
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


def test_only_the_cli_imports_the_estimator():
    """The estimator reads config, adapters and methods; nothing but the command line may depend on it."""
    importers = {
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if any(target == "estimate" for target, _ in _imports(path)) and path.name != "estimate.py"
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
        "methods",
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
