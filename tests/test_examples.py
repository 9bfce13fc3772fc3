"""Every example runs with --tiny (as CI does); the FlattenGPT one exits non-zero if the reload differs."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*/*_example.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_runs_tiny(script):
    result = subprocess.run([sys.executable, str(script), "--tiny"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plan:" in result.stdout
    if script.parent.name == "flattengpt":
        assert "logits equal: True" in result.stdout
    if script.parent.name == "compress_on_load":
        assert "without quantization_config" in result.stdout
