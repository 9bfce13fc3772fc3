"""push_to_hub: the upload path against the huggingface_hub client, with the transport replaced or unreachable."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten.export.hub import HubUploadError


class RecordingApi:
    """Stands in for HfApi at its network boundary: records what would be sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        from pathlib import Path

        self.calls.append(("upload_folder", {"repo_id": repo_id, "commit_message": commit_message}))
        self.uploaded = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}

        class Info:
            commit_url = f"https://huggingface.co/{repo_id}/commit/abc"

        return Info()


def _compressed():
    model = tiny_models.tiny_llama_gqa()
    model.config._name_or_path = "org/dense-model"
    return model, compress(model, "flattengpt", num_layers_to_remove=2)


def test_push_uploads_weights_report_heatmap_and_card(tmp_path):
    model, quantizer = _compressed()
    api = RecordingApi()
    url = quantizer.push_to_hub(
        model,
        "me/flat-model",
        local_dir=tmp_path / "flat",
        api=api,
        private=True,
        extra_report={"evaluation": {"dense": {"perplexity": 10.0}, "compressed": {"perplexity": 12.5}}},
    )
    assert url.endswith("/commit/abc")
    assert api.calls[0] == ("create_repo", {"repo_id": "me/flat-model", "private": True, "exist_ok": True})
    assert api.calls[1][1]["commit_message"].startswith("optimum-flatten: flattengpt 6 -> 4 layers")
    assert {"config.json", "model.safetensors", "flatten_report.json", "README.md", "similarity_heatmap.png"} <= set(
        api.uploaded
    )
    card = api.uploaded["README.md"].decode()
    assert "base_model: org/dense-model" in card
    merged = [list(g) for g in quantizer.plan.merged_groups]
    assert str(merged) in card and "| dense | 10.000 |" in card and "| compressed | 12.500 |" in card


def test_offline_upload_fails_clearly_and_keeps_the_local_save(tmp_path):
    model, quantizer = _compressed()
    # The real client, pointed at a closed port on this machine: the transport fails at once.
    api = HfApi(endpoint="http://127.0.0.1:9", token="hf_not_a_real_token")
    with pytest.raises(HubUploadError, match=r"could not upload to the Hub repo 'me/flat'.*saved at") as info:
        quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "flat", api=api)
    assert str(tmp_path / "flat") in str(info.value)
    # The retry it suggests uploads the checkpoint's files only, not what else the folder may keep.
    assert "--include config.json" in str(info.value) and "--include model.safetensors" in str(info.value)
    # ... and clears the stale shards of an earlier upload, as the library's push does.
    assert "--delete 'model-*-of-*.safetensors'" in str(info.value) and "upload upload" not in str(info.value)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "flat")
    assert_close(logits(reloaded, sample_ids()), logits(model, sample_ids()))


def test_licence_is_carried_from_a_local_base_card(tmp_path):
    base = tmp_path / "base"
    tiny_models.tiny_llama_gqa().save_pretrained(base)
    (base / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# base\n")
    model = AutoModelForCausalLM.from_pretrained(base)
    quantizer = compress(model, "shortgpt", num_layers_to_remove=1, nsamples=4)
    card = (quantizer.save(model, tmp_path / "out") / "README.md").read_text()
    assert "license: mit" in card and "mit, carried over from the base model." in card
