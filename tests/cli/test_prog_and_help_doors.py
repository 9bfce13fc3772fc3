"""Doors of the command line's own wording: a missing verb is refused (usage, exit 2) by both entry points, every
refusal under ``optimum-cli flatten`` names that command (not ``optimum-flatten``), and ``--help`` shows each
flag's default even where the flag has no help text of its own."""

from __future__ import annotations

import re
import subprocess

import pytest

from optimum_flatten.cli.main import main

VERBS = "compress, evaluate, recover, estimate, layer-collapse, demo"


def test_optimum_cli_flatten_without_a_verb_prints_the_usage_and_exits_2():
    """It exited 0 (no verb was handed on as ``--help``): a script that forgot its verb passed."""
    bare = subprocess.run(["optimum-cli", "flatten"], capture_output=True, text=True)
    assert bare.returncode == 2, (bare.stdout, bare.stderr)
    assert bare.stderr.startswith("usage: optimum-cli flatten ")
    assert "{compress,evaluate,recover,estimate,layer-collapse,demo}" in bare.stderr
    assert f"optimum-cli flatten: error: a verb is required: one of {VERBS}" in bare.stderr


def test_optimum_flatten_without_a_verb_prints_the_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: optimum-flatten ") and "optimum-flatten: error: a verb is required" in err


def test_refusals_under_optimum_cli_name_optimum_cli_flatten():
    """The parser was built with ``prog="optimum-flatten"`` whichever door the arguments came through."""
    argv = ["optimum-cli", "flatten", "estimate", "m", "--num-layers-to-remove", "1", "--max-grup-size", "2"]
    flag = subprocess.run(argv, capture_output=True, text=True)
    assert flag.returncode == 2
    assert flag.stderr.startswith("optimum-cli flatten estimate: error: unrecognized arguments: --max-grup-size 2.")
    assert "(see optimum-cli flatten estimate --help)" in flag.stderr
    assert "optimum-flatten" not in flag.stderr
    usage = subprocess.run(["optimum-cli", "flatten", "compress", "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: optimum-cli flatten compress ")
    # A refusal of the command itself, whose advice names another verb to run.
    demo = subprocess.run(["optimum-cli", "flatten", "demo", "--method", "ffn_merge"], capture_output=True, text=True)
    assert demo.returncode == 2, demo.stderr
    assert "`optimum-cli flatten compress smollm2 --method ...`" in demo.stderr
    assert "optimum-flatten" not in demo.stderr


def _help_entries(text: str) -> dict[str, str]:
    """``{flag: its help text}`` of a ``--help`` page, whitespace collapsed."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif flag is not None:
            entries[flag] += " " + line
    return {name: " ".join(entry.split()) for name, entry in entries.items()}


def test_demo_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--help"])
    assert exited.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    defaults = {
        "--method": "flattengpt",
        "--num-layers-to-remove": "6",
        "--nsamples": "32",
        "--seqlen": "512",
        "--eval-tokens": "16384",
        "--eval-seqlen": "512",
        "--speed-rounds": "5",
    }
    for flag, value in defaults.items():
        assert entries[flag].endswith(f"(default: {value})"), entries[flag]
    assert "default" not in entries["--output"] and "default" not in entries["--no-progress"]


def test_a_flag_without_help_text_still_shows_its_default(capsys):
    """compress's ``--dtype`` is declared without help: argparse printed nothing after it."""
    with pytest.raises(SystemExit):
        main(["compress", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert re.fullmatch(r"--dtype \{float32,bfloat16,float16\} \(default: float32\)", entries["--dtype"])
