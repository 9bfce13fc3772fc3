"""`compress --heal-*` and the API's save where a review of the launchers and the MoE saves found them wrong: a heal
the plan leaves nothing to train for raised after the compression (the command then saved nothing); mode 'local'
under a launch of several processes was refused only after the compression; `FlattenQuantizer.save` of a model
compressed on load wrote an empty report; the healing's row length had no flag; a launch's cost read as the whole
calibration's while it counted one rank's share."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import one_error_line
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.cli.main import main

COMPRESS = ["--num-layers-to-remove", "2", "--nsamples", "8", "--seqlen", "32", "--batch-size", "2", "--no-progress"]


@pytest.fixture
def first_layers_least_influential(monkeypatch):
    """ShortGPT's scores with layers 0 and 1 the least influential: it drops them, and no bridge can stand in for
    the first layers of a stack (nothing before them to fit from)."""
    import optimum_flatten.methods.shortgpt as shortgpt

    def scores(adapter, context):
        return torch.arange(adapter.num_layers(context.stack), dtype=torch.float64)

    monkeypatch.setattr(shortgpt, "block_influence", scores)


def test_a_heal_with_nothing_to_train_keeps_the_compression_and_says_so(llama_on_disk, tmp_path, capsys,
                                                                        first_layers_least_influential):  # fmt: skip
    model, text = llama_on_disk
    out = tmp_path / "out"
    argv = ["compress", str(model), "--method", "shortgpt", "--linear-replacement", "lstsq", "--dataset", str(text),
            *COMPRESS, "--heal-tokens", "256", "--heal-mode", "changed", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr()
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["plan_summary"].endswith("dropped [0, 1]")
    assert (
        report["recovery"]["mode"] == "changed"
        and "found nothing the compression changed" in (report["recovery"]["skipped"])
    )
    warnings = [line for line in printed.err.splitlines() if "the healing was skipped" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:")  # once, not also as a Python warning
    assert "skipped (changed: nothing to train)" in printed.out
    assert "- Healing: not run; the healing was skipped" in (out / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(out)  # the compressed model was saved


def test_the_api_warns_of_a_skipped_heal(llama_on_disk, first_layers_least_influential):
    from transformers import AutoTokenizer

    path, text = llama_on_disk
    model = AutoModelForCausalLM.from_pretrained(path)
    heal = {"max_tokens": 256, "seqlen": 32, "mode": "changed", "heldout_rows": 0}
    config = FlattenConfig(method="shortgpt", linear_replacement="lstsq", num_layers_to_remove=2, dataset=str(text),
                           nsamples=8, seqlen=32, batch_size=2, heal=heal)  # fmt: skip
    quantizer = FlattenQuantizer(config, progress=False)
    with pytest.warns(UserWarning, match="the healing was skipped and the model kept as compressed"):
        quantizer.compress(model, AutoTokenizer.from_pretrained(path))
    assert quantizer.report.to_dict()["recovery"]["skipped"]


def test_local_under_a_launch_of_two_is_refused_before_any_weight_changes(monkeypatch):
    import optimum_flatten.quantizer as quantizer_module

    monkeypatch.setattr(quantizer_module, "process_group", lambda: (0, 2))
    model = tiny_models.tiny_llama_gqa()
    before = copy.deepcopy(model.state_dict())
    config = FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=tiny_models.sample_texts(60),
                           nsamples=8, seqlen=32, batch_size=2, tokenizer=tiny_models.CharTokenizer(),
                           heal={"max_tokens": 256, "seqlen": 32, "mode": "local"})  # fmt: skip
    with pytest.raises(ValueError, match=r"mode='local' trains on one process .* got 2 processes"):
        FlattenQuantizer(config, progress=False).compress(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_save_after_a_compression_on_load_writes_the_models_report(llama_on_disk, tmp_path):
    from transformers import AutoTokenizer

    path, text = llama_on_disk
    config = FlattenConfig(method="replaceme", num_layers_to_remove=2, dataset=str(text), nsamples=8, seqlen=32,
                           batch_size=2)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    out = FlattenQuantizer(config).save(model, tmp_path / "out", AutoTokenizer.from_pretrained(path))
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["method"] == "replaceme" and report["plan_summary"] == model.flatten_report["plan_summary"]
    card = (out / "README.md").read_text()
    assert "- Method: `replaceme` with options" in card
    assert "`None`" not in card and "? layers" not in card


def test_the_healings_row_length_has_a_flag(llama_on_disk, tmp_path, capsys):
    model, text = llama_on_disk
    out = tmp_path / "out"
    argv = ["compress", str(model), "--method", "shortgpt", "--dataset", str(text), *COMPRESS, "--heal-seqlen", "16"]
    assert main([*argv, "--heal-tokens", "128", "--heal-mode", "full", "--output", str(out)]) == 0
    assert json.loads((out / "flatten_report.json").read_text())["recovery"]["seqlen"] == 16
    assert main([*argv, "--output", str(tmp_path / "o2")]) == 2
    assert "--heal-save-every need --heal-tokens" in one_error_line(capsys)


def test_the_healing_in_compress_goes_on_from_its_checkpoints_after_a_stop(llama_on_disk, tmp_path, monkeypatch,
                                                                          capsys):  # fmt: skip
    """A review stopped `compress --heal-tokens` mid-healing: run again, it trained from step 0 and sampled again,
    with no flag to keep its state (hours at 7B). ``--heal-checkpoint-dir`` keeps it: the same command goes on from
    the last checkpoint and ends on the weights of a run never stopped, and no saved config names the folder."""
    from safetensors.torch import load_file

    from optimum_flatten.recovery import resume as resume_module

    model, text = llama_on_disk
    argv = ["compress", str(model), "--method", "shortgpt", "--dataset", str(text), *COMPRESS]
    argv += ["--heal-tokens", "1024", "--heal-mode", "full", "--heal-seqlen", "16"]
    assert main([*argv, "--output", str(tmp_path / "whole")]) == 0
    checkpoints, out = tmp_path / "checkpoints", tmp_path / "out"
    resumable = [*argv, "--heal-checkpoint-dir", str(checkpoints), "--heal-save-every", "2", "--output", str(out)]

    class Stopped(Exception):
        """Stands for the process being killed (no error the command line turns into a message)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise Stopped
        return control

    with monkeypatch.context() as patch:
        patch.setattr(resume_module.CheckpointState, "on_step_end", on_step_end, raising=False)
        with pytest.raises(Stopped):
            main(resumable)
    assert not out.exists()
    capsys.readouterr()
    assert main(resumable) == 0
    # The checkpoints left behind are said, as recover says them (the command printed nothing of them).
    printed = capsys.readouterr().out
    assert f"GiB left in {checkpoints} (phase-1" in printed and "), needed only to resume this healing" in printed
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["recovery"]["resumed_from_step"] == [2]
    whole, resumed = (load_file(str(folder / "model.safetensors")) for folder in (tmp_path / "whole", out))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert str(checkpoints) not in "".join(path.read_text() for path in out.glob("*.json"))
