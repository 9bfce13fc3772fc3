"""``--push-to-hub REPO`` and ``--private`` on every verb that saves a model (`compress`, `recover`,
`layer-collapse`), with the Hub client replaced at its network boundary: the checkpoint uploaded is the one saved
to ``--output`` (which reloads to the same logits), the repo is created private when asked, and a push that cannot
happen (an invalid repo id, ``--private`` without a push) is refused before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny_models
from common import one_error_line
from optimum_flatten.cli.main import main
from tests.cli.test_layer_collapse_doors import SCHEDULE
from tests.test_hub import RecordingApi, _online

#: What every upload must hold: the weights, their config and the report the card is written from.
CHECKPOINT = {"config.json", "model.safetensors", "flatten_report.json", "README.md"}


@pytest.fixture
def hub(monkeypatch) -> RecordingApi:
    """The one client every push of the test makes (the commands build theirs with `huggingface_hub.HfApi()`)."""
    _online(monkeypatch)
    api = RecordingApi()
    monkeypatch.setattr("huggingface_hub.HfApi", lambda token=None: api)
    return api


def _uploaded_as_saved(folder, api: RecordingApi, remote_code: bool = False) -> None:
    """Every file of the saved folder is uploaded as it is (a partly collapsed model's modelling code too, without
    which the repo would not load), and the folder reloads with transformers."""
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == api.uploaded
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote_code)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()


def test_recover_uploads_the_healed_checkpoint_privately(pair, tmp_path, hub, capsys):
    dense, compressed, text = pair
    out = tmp_path / "healed"
    argv = ["recover", str(compressed), "--teacher", str(dense), "--dataset", str(text), "--seqlen", "32",
            "--max-tokens", "256", "--output", str(out), "--push-to-hub", "me/healed", "--private",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert hub.calls[0] == ("create_repo", {"repo_id": "me/healed", "private": True, "exist_ok": True})
    assert CHECKPOINT <= set(hub.uploaded) and "uploaded: https://huggingface.co/me/healed/commit/abc" in (
        capsys.readouterr().out
    )
    # The report uploaded is the healed one: it records the healing, on the text it ran on.
    assert json.loads(hub.uploaded["flatten_report.json"])["recovery"]["dataset"] == "text.txt"
    _uploaded_as_saved(out, hub)


def test_layer_collapse_uploads_what_it_saved(tmp_path, hub, capsys):
    path = tmp_path / "gpt2"
    tiny_models.tiny_gpt2().save_pretrained(path)
    tiny_models.tiny_hf_tokenizer().save_pretrained(path)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny_models.sample_texts(40)))
    out = tmp_path / "out"
    argv = ["layer-collapse", str(path), "--dataset", str(text), "--num-mlps", "1", "--nsamples", "2", *SCHEDULE,
            "--output", str(out), "--push-to-hub", "me/collapsed", "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    # No --private: the Hub's default visibility (an existing repo's stays as it is).
    assert hub.calls[0] == ("create_repo", {"repo_id": "me/collapsed", "private": None, "exist_ok": True})
    assert CHECKPOINT <= set(hub.uploaded) and "training" in json.loads(hub.uploaded["flatten_report.json"])
    assert f"saved to {out} and uploaded: https://huggingface.co/me/collapsed/commit/abc" in capsys.readouterr().out
    _uploaded_as_saved(out, hub, remote_code=True)


def test_compress_creates_the_repo_private_when_asked(pair, tmp_path, hub, capsys):
    model_path, _, data = pair
    out = tmp_path / "out"
    argv = ["compress", str(model_path), "--num-layers-to-remove", "1", "--method", "shortgpt", "--nsamples", "4",
            "--dataset", str(data), "--output", str(out), "--push-to-hub", "me/flat", "--private",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert hub.calls[0] == ("create_repo", {"repo_id": "me/flat", "private": True, "exist_ok": True})
    _uploaded_as_saved(out, hub)


@pytest.mark.parametrize("verb", ["compress", "recover", "layer-collapse"])
@pytest.mark.parametrize("push", [[], ["--push-to-hub", "a/b/c"]], ids=["private alone", "bad repo id"])
def test_a_push_that_cannot_happen_is_refused_before_the_model_loads(pair, tmp_path, hub, capsys, monkeypatch, verb,
                                                                    push):  # fmt: skip
    import transformers

    monkeypatch.setattr("optimum_flatten.cli.main._load", lambda *a, **k: pytest.fail("loaded before refusing"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    dense, compressed, text = pair
    out = tmp_path / "out"
    argv = {
        "compress": ["compress", str(dense), "--num-layers-to-remove", "1", "--method", "shortgpt"],
        "recover": ["recover", str(compressed), "--teacher", str(dense), "--max-tokens", "256"],
        "layer-collapse": ["layer-collapse", str(dense), "--num-mlps", "1"],
    }[verb]
    private = [] if push else ["--private"]
    assert main([*argv, "--dataset", str(text), "--output", str(out), *push, *private]) == 2
    message = one_error_line(capsys)
    assert ("not a valid Hub repo id" if push else "--private applies to the repo --push-to-hub creates") in message
    assert not out.exists() and hub.calls == []
