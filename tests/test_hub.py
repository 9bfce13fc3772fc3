"""push_to_hub: the upload path against the huggingface_hub client, with the transport replaced or unreachable."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten import FlattenConfig, FlattenQuantizer
from optimum_flatten.export import hub
from optimum_flatten.export.hub import HubUploadError, check_hub_repo


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


def _online(monkeypatch) -> None:
    """Clears huggingface_hub's offline mode, which `push_to_hub` refuses up front for its real client."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def test_offline_upload_fails_clearly_and_keeps_the_local_save(tmp_path, monkeypatch):
    _online(monkeypatch)
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


def _no_save(monkeypatch) -> None:
    """Makes any save fail the test: a refusal must come before the checkpoint is written."""

    def save(*args, **kwargs):
        raise AssertionError("the checkpoint was saved before the push was refused")

    monkeypatch.setattr(hub, "save_compressed", save)


@pytest.mark.parametrize("repo_id", ["bad repo id", "a/b/c", "me/two--dashes", "me/name.git", ""])
def test_an_invalid_repo_id_is_refused_in_one_line_before_the_save(repo_id, tmp_path, monkeypatch):
    _no_save(monkeypatch)
    api = RecordingApi()
    quantizer = FlattenQuantizer(
        FlattenConfig(method="shortgpt", num_layers_to_remove=1)
    )  # never compressed: nothing may reach the model
    for push in (
        lambda: quantizer.push_to_hub(object(), repo_id, local_dir=tmp_path / "out", api=api),
        lambda: hub.push_to_hub(object(), repo_id, local_dir=tmp_path / "out", api=api),
    ):
        with pytest.raises(ValueError, match="is not a valid Hub repo id") as info:
            push()
        message = str(info.value)
        assert "\n" not in message and repr(repo_id) in message and "'namespace/name'" in message
    assert api.calls == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_is_refused_before_the_save(variable, tmp_path, monkeypatch):
    """Read when the push starts (huggingface_hub reads it once, at import): the default client and a real `HfApi`
    would fail at the upload, after the work, so the push is refused first and says what to do instead."""
    _online(monkeypatch)
    monkeypatch.setenv(variable, "1")
    _no_save(monkeypatch)
    quantizer = FlattenQuantizer(FlattenConfig(method="shortgpt", num_layers_to_remove=1))
    for api in (None, HfApi(endpoint="http://127.0.0.1:9", token="hf_not_a_real_token")):
        with pytest.raises(ValueError, match="offline mode is on") as info:
            quantizer.push_to_hub(object(), "me/flat", local_dir=tmp_path / "out", api=api)
        message = str(info.value)
        assert "\n" not in message and f"unset {variable}" in message and "hf upload" in message
    with pytest.raises(ValueError, match="offline mode is on"):
        check_hub_repo("me/flat")
    assert not (tmp_path / "out").exists()


def test_offline_mode_does_not_refuse_a_stand_in_transport(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, quantizer = _compressed()
    api = RecordingApi()
    assert quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "flat", api=api).endswith("/commit/abc")
    check_hub_repo("me/flat", api)  # the check itself, as the CLI calls it before compressing, with a stand-in


class StaleRepoApi(RecordingApi):
    """A repo holding an earlier upload: deletes what `delete_patterns` selects among its files, matched as the
    Hub client matches them (`filter_repo_objects`), unless the upload sends the file again."""

    REMOTE = (
        ".gitattributes",
        "additional_chat_templates/tool_use.jinja",
        "model-00001-of-00003.safetensors",
        "model.safetensors.index.json",
        "notes.md",
    )

    def upload_folder(self, *, repo_id, folder_path, delete_patterns=None, **kwargs):
        self.deleted = sorted(filter_repo_objects(self.REMOTE, allow_patterns=delete_patterns))
        return super().upload_folder(repo_id=repo_id, folder_path=folder_path, **kwargs)


def test_an_upload_deletes_the_files_inside_a_stale_checkpoint_folder(tmp_path, monkeypatch):
    _online(monkeypatch)
    assert list(filter_repo_objects(["additional_chat_templates/t.jinja"], allow_patterns=hub._stale_patterns())) == [
        "additional_chat_templates/t.jinja"
    ]
    model, quantizer = _compressed()
    api = StaleRepoApi()
    quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "flat", api=api)
    assert api.deleted == [
        "additional_chat_templates/tool_use.jinja",
        "model-00001-of-00003.safetensors",
        "model.safetensors.index.json",
    ]


class FailingApi(RecordingApi):
    """The repo is created, the upload fails (as a dropped connection would)."""

    def upload_folder(self, **kwargs):
        raise ConnectionError("connection reset by peer")


def _failed_upload_message(tmp_path, monkeypatch) -> str:
    _online(monkeypatch)
    model, quantizer = _compressed()
    with pytest.raises(HubUploadError) as info:
        quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "flat", api=FailingApi())
    return str(info.value)


def test_the_retry_a_failed_upload_suggests_clears_a_stale_checkpoint_folder(tmp_path, monkeypatch):
    message = _failed_upload_message(tmp_path, monkeypatch)
    assert "--delete 'additional_chat_templates/*'" in message and "--delete additional_chat_templates " not in message


def test_a_failed_upload_suggests_a_login_the_cli_offers(tmp_path, monkeypatch):
    """The CLI has no token option: the saved login or HF_TOKEN is what it reads; token= is the API's alone."""
    message = _failed_upload_message(tmp_path, monkeypatch)
    assert "`hf auth login`" in message and "HF_TOKEN" in message and "push_to_hub(..., token=...)" in message
    assert "or pass token=)" not in message


class GlobbingApi(RecordingApi):
    """Uploads what `allow_patterns` selects, matched as the Hub client matches it, into a local folder."""

    def __init__(self, repo) -> None:
        super().__init__()
        self.repo = repo

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, **kwargs):
        import shutil
        from pathlib import Path

        files = [str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (self.repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(folder_path) / name, self.repo / name)
        return super().upload_folder(repo_id=repo_id, folder_path=folder_path, **kwargs)


def test_a_remote_code_tokenizer_is_published_with_its_modules(tmp_path):
    """The tokenizer's own Python files match no checkpoint pattern (their names are the model's); the upload finds
    them through the auto_map, so the published repo's tokenizer loads."""
    from transformers import AutoTokenizer

    model, quantizer = _compressed()
    tokenizer = tiny_models.remote_code_tokenizer(tmp_path / "source")
    repo = tmp_path / "repo"
    repo.mkdir()
    quantizer.push_to_hub(model, "me/flat", tokenizer, local_dir=tmp_path / "flat", api=GlobbingApi(repo))
    published = sorted(p.name for p in repo.iterdir())
    assert {"tokenization_tiny.py", "tokenization_tiny_helpers.py", "tokenizer_config.json"} <= set(published)
    loaded = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
    assert type(loaded).__name__ == "TinyRemoteTokenizer" and loaded.suffix == "Tiny"
    assert loaded("a b c")["input_ids"] == tokenizer("a b c")["input_ids"]


def test_the_retry_of_a_private_upload_stays_private(tmp_path, monkeypatch):
    """`hf upload` creates a missing repo public unless told: the retry dropped --private (and the commit message)."""
    import shlex

    _online(monkeypatch)
    model, quantizer = _compressed()
    with pytest.raises(HubUploadError) as info:
        quantizer.push_to_hub(model, "me/flat", local_dir=tmp_path / "flat", private=True, api=FailingApi())
    retry = shlex.split(str(info.value).split("`hf upload", 1)[1].split("`.", 1)[0])
    assert "--private" in retry and retry[retry.index("--commit-message") + 1].startswith("optimum-flatten: flattengpt")
    public = _failed_upload_message(tmp_path / "public", monkeypatch)
    assert "--private" not in public
