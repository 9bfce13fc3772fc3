"""Save -> reload without optimum_flatten: same class, same logits, cached generation equals uncached.

Saving over an existing folder (overwrite, refusals, interrupted saves) is tested in test_save_overwrite.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tiny_models
from common import assert_close, compress, logits, sample_ids

RELOAD_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
path, ids_path, out_path = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model(input_ids=ids).logits
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(ids[:1, :5], use_cache=True, **kwargs)
    uncached = model.generate(ids[:1, :5], use_cache=False, **kwargs)
torch.save({"logits": logits, "cached": cached, "uncached": uncached}, out_path)
print(json.dumps({
    "class": type(model).__name__,
    "layers": model.config.num_hidden_layers,
    "has_quantization_config": hasattr(model.config, "quantization_config"),
    "imported_optimum_flatten": any(m.startswith("optimum_flatten") for m in sys.modules),
}))
"""


def _compressed(factory="llama_gqa", method="flattengpt"):
    model = tiny_models.FACTORIES[factory]()
    return model, compress(model, method, num_layers_to_remove=2)


@pytest.mark.parametrize("factory", ["llama_gqa", "qwen2", "mistral"])
def test_save_reload_in_a_fresh_process_without_the_package(tmp_path, factory):
    model, quantizer = _compressed(factory)
    out = quantizer.save(model, tmp_path / "compressed")
    ids = sample_ids()
    torch.save(ids, tmp_path / "ids.pt")
    script = tmp_path / "reload.py"
    script.write_text(RELOAD_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info == {
        "class": type(model).__name__,
        "layers": 4,
        "has_quantization_config": False,
        "imported_optimum_flatten": False,
    }
    reloaded = torch.load(tmp_path / "out.pt")
    assert_close(reloaded["logits"], logits(model, ids))
    assert torch.equal(reloaded["cached"], reloaded["uncached"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 4
    if factory == "qwen2":
        assert len(config["layer_types"]) == 4


def test_saved_directory_holds_report_card_and_heatmap(tmp_path):
    model, quantizer = _compressed()
    out = quantizer.save(model, tmp_path / "compressed")
    report = json.loads((out / "flatten_report.json").read_text())
    assert report["plan"]["groups"] == quantizer.plan.group_lists()
    assert len(report["similarity"]) == 6
    card = (out / "README.md").read_text()
    merged = [list(g) for g in quantizer.plan.merged_groups]
    assert f"Merged groups (original 0-based layer indices): {merged}" in card
    assert "6 -> 4 layers" in card and "AutoModelForCausalLM.from_pretrained" in card
    png = (out / "similarity_heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "![Layer-input similarity, merged groups outlined](similarity_heatmap.png)" in card


def test_card_and_report_name_a_local_base_by_its_folder_only(tmp_path):
    """A model loaded from a local folder is recorded by the folder's name: its absolute path would reach the Hub
    with --push-to-hub, and `base_model:` in the card's front matter is reserved for a Hub id."""
    from transformers import AutoModelForCausalLM

    dense = tmp_path / "private" / "checkpoints" / "dense-model"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    (dense / "README.md").write_text("---\nlicense: mit\n---\n")
    model = AutoModelForCausalLM.from_pretrained(dense).eval()
    quantizer = compress(model, "flattengpt", num_layers_to_remove=2)
    assert (quantizer.report["base_model"], quantizer.report["base_model_on_hub"]) == ("dense-model", False)
    assert quantizer.report["license"] == "mit"  # still read from the source folder
    out = quantizer.save(model, tmp_path / "out")
    card = (out / "README.md").read_text()
    for written in (card, (out / "flatten_report.json").read_text()):
        assert str(dense) not in written and "private" not in written
    assert "base_model:" not in card and "- Base model: `dense-model`, a local checkpoint folder" in card
    assert "# dense-model compressed with optimum-flatten" in card


def test_card_of_an_older_report_with_an_absolute_path_shows_the_folder_name_only():
    from optimum_flatten.export.model_card import render_model_card

    card = render_model_card({"base_model": "/home/someone/models/dense", "method": "shortgpt"})
    assert "/home/someone" not in card and "base_model:" not in card and "`dense`" in card
    card = render_model_card({"base_model": "org/dense-model", "method": "shortgpt"})
    assert "base_model: org/dense-model" in card


def test_the_card_names_the_text_a_healing_trained_on_the_teachers_included():
    """A healing on the user's file, on the teacher's own text only (the file not read), and on a mix."""
    from optimum_flatten.export.model_card import render_model_card

    def healing(**recovery):
        return render_model_card({"recovery": {"mode": "full", "tokens_trained": 64, "steps": 1, **recovery}})

    sampled = {"share": 0.5, "start": "prompts"}
    assert "on text.txt (64 tokens" in healing(dataset="text.txt", data_kind="text")
    teacher = healing(dataset="text.txt", data_kind="teacher", teacher_text={**sampled, "share": 1.0})
    assert "on the teacher's own text (continuing the user's prompts) (64 tokens" in teacher
    assert "text.txt" not in teacher
    mixed = healing(dataset="text.txt", data_kind="mixed", teacher_text={**sampled, "start": "bos"})
    assert "on 50% the teacher's own text (from its start token), the rest text.txt (64 tokens" in mixed
