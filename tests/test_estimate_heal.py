"""`optimum-flatten estimate --heal` against what ``compress --heal-tokens`` chooses and holds.

The healing's default mode follows a memory check (`recovery.footprint.ModeChoice`) that `compress` runs before it
compresses, on the dense model with the teacher copy still to be taken. The estimate runs that same check
(`recovery.mode.compress_heal_mode`) on the model built on meta, so for one model, one free memory and one set of
options the two answer alike; and the healing's own peak (teacher, training state, activations) is a phase of the
estimate, so that its overall peak is the run's.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

import tiny_models
from common import write_llama2_7b_config
from optimum_flatten.cli.main import main
from optimum_flatten.estimate import compressed_shape_, meta_model
from optimum_flatten.recovery import RecoveryConfig
from optimum_flatten.recovery import footprint as memory_check
from optimum_flatten.recovery.footprint import HEADROOM, candidate_footprints, full_footprint, weight_bytes

#: The healing rows of these tests (the tiny model has 128 positions; the default is 256).
HEAL_SEQLEN = 32
ESTIMATE = ["--method", "shortgpt", "--num-layers-to-remove", "2", "--json", "--heal"]


def _estimate(capsys, folder, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["estimate", str(folder), *ESTIMATE, *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny LLaMA saved as a checkpoint with a tokenizer, and a text to calibrate and heal on."""
    folder = tmp_path_factory.mktemp("dense")
    tiny_models.tiny_llama_gqa().save_pretrained(folder)
    tiny_models.tiny_hf_tokenizer().save_pretrained(folder)
    text = folder / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(200)))
    return folder


def test_estimate_heal_chooses_the_mode_compress_heal_tokens_chooses(dense, tmp_path, monkeypatch, capsys):
    """On a device with `free` bytes once the dense model is loaded, the estimate's choice is compress's, memory
    line for memory line. At this budget the estimate used to size the compressed model with no teacher, whose
    AdamW fits: it said the default trains AdamW with every weight, where compress freezes the embeddings."""
    healing = RecoveryConfig(seqlen=HEAL_SEQLEN)
    model = meta_model(str(dense))  # as compress loads it: float32, SDPA
    weights = weight_bytes(model)
    dense_sizes = dict(candidate_footprints(model, healing, weights, accelerator=False))
    frozen = dense_sizes["with the token embeddings and the LM head frozen"]
    free = math.ceil(frozen.total / HEADROOM) + 1  # frozen embeddings fit, all of them trained do not
    assert not dense_sizes["as asked"].fits(free) and frozen.fits(free)
    old = full_footprint(compressed_shape_(meta_model(str(dense)), 2), healing, accelerator=False)
    assert old.state + old.activations + 2 * weights <= HEADROOM * free  # what the estimate said: AdamW fits

    # compress reads the device with the dense model on it; the estimate reads it before any model is loaded. Both
    # train in host memory here, as on a machine without CUDA (a GPU would take the weights moved to it from `free`).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: free)
    argv = [
        *("compress", str(dense), "--method", "shortgpt", "--num-layers-to-remove", "2", "--dataset"),
        *(str(dense / "text.txt"), "--nsamples", "4", "--seqlen", "32", "--no-progress"),
        *("--output", str(tmp_path / "out"), "--heal-tokens", "128", "--heal-seqlen", str(HEAL_SEQLEN)),
    ]
    assert main(argv) == 0
    ran = json.loads((tmp_path / "out" / "flatten_report.json").read_text())["recovery"]
    assert ran["mode"] == "full" and ran["embeddings"].startswith("frozen")
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: free + weights)
    read = _estimate(capsys, dense, "--heal-seqlen", str(HEAL_SEQLEN))
    given = _estimate(
        capsys, dense, "--heal-seqlen", str(HEAL_SEQLEN), "--free-memory-gib", repr((free + weights) / 2**30)
    )
    for estimate in (read, given):
        heal = estimate["heal"]
        assert (heal["mode"], heal["train_embeddings"], heal["optimizer"]) == ("full", False, None)
        assert heal["mode_chosen"] == ran["mode_chosen"]  # the same check: the same lines, byte for byte
        assert heal["free_with_the_model_loaded_bytes"] == free


def test_the_healing_is_a_phase_and_the_peak_is_the_larger(tmp_path, capsys):
    """LLaMA-2-7B in bfloat16, 8 of 32 layers removed, on an 80 GB GPU (79.6 GiB): the healing's phase is the
    footprint of the candidate the check chose (the teacher copy, AdamW's state or a lean optimiser's, a step's
    activations), and the estimate's peak is the larger of it and the compression's, with the weights."""
    write_llama2_7b_config(tmp_path)
    argv = ["--dtype", "bfloat16", "--device", "h100", "--free-memory-gib", "79.6"]
    capsys.readouterr()
    assert main(["estimate", str(tmp_path), *ESTIMATE[:-2], "--json", *argv[:2]]) == 0
    plain = json.loads(capsys.readouterr().out)
    result = _estimate(capsys, tmp_path, *argv)
    weights = plain["weights_bytes"]
    phases = {p["name"]: p["workspace_bytes"] for p in result["phases"]}
    for phase in plain["phases"]:  # the teacher copy, taken before the first weight change, in every phase
        assert phases[phase["name"]] == phase["workspace_bytes"] + weights
    heal = result["heal"]
    # The run's choice there: AdamW's state does not fit beside the dense student and its copy; 8-bit AdamW does,
    # and Adafactor where bitsandbytes is not installed.
    assert (heal["mode"], heal["optimizer"], heal["train_embeddings"]) == ("full", "adamw_bnb_8bit", None)
    assert heal["without_bitsandbytes"]["optimizer"] == "adafactor"
    model = meta_model(str(tmp_path), "bfloat16")
    chosen = RecoveryConfig(extra_training_args={"optim": "adamw_bnb_8bit"})
    expected = full_footprint(model, chosen, weight_bytes(model), accelerator=True)
    assert heal["footprint"] == {"state": expected.state, "activations": expected.activations,
                                 "teacher": expected.teacher, "sampling": 0}  # fmt: skip
    assert phases["healing"] == expected.total
    assert result["workspace_bytes"]["peak_phase"] == "healing"
    assert result["peak_bytes"] == weights + max(phases.values()) == weights + expected.total
    assert expected.total <= HEADROOM * (round(79.6 * 2**30) - weight_bytes(model))
    assert any(note.startswith("heal: mode='full' with optimiser adamw_bnb_8bit") for note in result["notes"])


def test_where_no_full_healing_fits_the_phase_holds_the_teacher_copy_and_says_local(tmp_path, capsys):
    write_llama2_7b_config(tmp_path)
    result = _estimate(capsys, tmp_path, "--dtype", "bfloat16", "--device", "h100", "--free-memory-gib", "30")
    assert result["heal"]["mode"] == "local" and result["heal"]["footprint"] is None
    (phase,) = [p for p in result["phases"] if p["name"].startswith("healing")]
    copy = weight_bytes(meta_model(str(tmp_path), "bfloat16"))  # the teacher copy the check counts
    assert phase["name"] == "healing (local)" and phase["workspace_bytes"] == copy
    assert any("not modelled" in note for note in result["notes"])


def test_the_fallbacks_are_sized_as_the_check_sizes_them(tmp_path, capsys, monkeypatch):
    """`heal_fallbacks` lists what each candidate adds beside the teacher copy, on the dense model (the check's
    student), in the default's order; without a GPU named, in host memory's factor."""
    write_llama2_7b_config(tmp_path)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 2**45)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = _estimate(capsys, tmp_path)
    model = meta_model(str(tmp_path))
    expected = candidate_footprints(model, RecoveryConfig(), weight_bytes(model), accelerator=False)
    assert result["heal_fallbacks"]["full_bytes"] == {name: f.state + f.activations for name, f in expected}
    assert next(iter(result["heal_fallbacks"]["full_bytes"])) == "as asked" and len(expected) == 6
    assert result["heal_full_bytes"] == {"state": expected[0][1].state, "activations": expected[0][1].activations}
    assert result["heal"]["mode"] == "full" and result["heal"]["device"] == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--free-memory-gib", "80"], "--free-memory-gib sizes the healing and the own rows' sampling: give it with"),
        (["--heal-seqlen", "128"], "--heal-seqlen sizes the healing: give it with --heal"),
        (["--heal", "--free-memory-gib", "0"], "--free-memory-gib must be a positive number"),
        (["--heal", "--device", "h100"], "needs --free-memory-gib"),
        (["--heal", "--heal-seqlen", "0"], "--heal-seqlen must be at least 2"),
        (["--heal", "--heal-seqlen", "1"], "--heal-seqlen must be at least 2"),  # was RecoveryConfig's, unnamed
        (["--heal", "--free-memory-gib", "inf"], "a positive number of GiB, and finite"),  # was an OverflowError
        (["--heal", "--free-memory-gib", "1e300"], "a positive number of GiB, and finite"),
    ],
)
def test_estimate_heal_refusals_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    write_llama2_7b_config(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine with no GPU to read
    assert main(["estimate", str(tmp_path), "--method", "shortgpt", "--num-layers-to-remove", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_after_a_merge_the_estimate_records_the_split_the_run_records(dense, tmp_path, capsys):
    """FlattenGPT merges layers, after which a default `full` trains `local` for half the tokens, then the global
    loss. The estimate's JSON said `full` (its note said otherwise); it now records what the run's report does."""
    argv = ["--method", "flattengpt", "--num-layers-to-remove", "2", "--nsamples", "4", "--seqlen", "32"]
    capsys.readouterr()
    assert main(["estimate", str(dense), *argv, "--json", "--heal", "--heal-seqlen", str(HEAL_SEQLEN)]) == 0
    heal = json.loads(capsys.readouterr().out)["heal"]
    out = tmp_path / "out"
    assert main(["compress", str(dense), *argv, "--dataset", str(dense / "text.txt"), "--no-progress",
                 "--heal-tokens", "256", "--heal-seqlen", str(HEAL_SEQLEN), "--output", str(out)]) == 0  # fmt: skip
    ran = json.loads((out / "flatten_report.json").read_text())["recovery"]
    assert ran["mode"] == heal["mode"] == "local"
    assert ran["mode_chosen"] == heal["mode_chosen"]
    assert heal["mode_chosen"].endswith("local, then the global loss, half the budget each")


def test_after_a_merge_the_fallback_without_bitsandbytes_is_recorded_as_the_run_would_split_it(tmp_path, capsys):
    """A review read `heal.mode` 'local' beside `without_bitsandbytes.mode` 'full' for FlattenGPT at LLaMA-2-7B on
    an 80 GB GPU: the fallback skipped the split after a merge that the main choice records, and the note said the
    global phase trains 'this' (full) where it trains the same blocks."""
    write_llama2_7b_config(tmp_path)
    argv = ["--method", "flattengpt", "--num-layers-to-remove", "8", "--dtype", "bfloat16", "--device", "h100"]
    capsys.readouterr()
    assert main(["estimate", str(tmp_path), *argv, "--free-memory-gib", "79.6", "--json", "--heal"]) == 0
    result = json.loads(capsys.readouterr().out)
    heal, other = result["heal"], result["heal"]["without_bitsandbytes"]
    assert (heal["mode"], heal["optimizer"]) == ("local", "adamw_bnb_8bit")
    assert (other["mode"], other["optimizer"]) == ("local", "adafactor")
    assert other["mode_chosen"].endswith("local, then the global loss, half the budget each")
    words = "mode='local', then the global loss on the same blocks, with optimiser adafactor"
    assert f"heal: without bitsandbytes on the device: {words}" in result["notes"]
    assert any("then the global loss on the same blocks (counted at full's footprint" in n for n in result["notes"])
