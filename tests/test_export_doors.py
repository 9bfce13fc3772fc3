"""The export's doors to the outside: an output folder that is a mount point, and the upload to the Hub.

A Docker ``-v`` volume or a Kubernetes PVC is an existing folder on another filesystem than its parent (which is
often read-only): a rename between the two fails with "Invalid cross-device link". Here such a mount is simulated by
making every rename in or out of the folder fail with EXDEV, as the kernel does, and a read-only parent by refusing
every write in it. A save there must work with no rename across it, and keep what an atomic save promises: an
error leaves the old files as they were and no hidden folder. An upload publishes what the save wrote and nothing
that ``overwrite`` kept in the folder.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

import tiny_models
from common import compress
from optimum_flatten.export.atomic import remove_leftovers
from optimum_flatten.export.checkpoint import check_output_dir
from optimum_flatten.export.hub import upload_patterns
from optimum_flatten.utils.errors import OutputDirectoryError

USER_FILES = {"notes.env": "HF_TOKEN=hf_secret\n", "eval/results.csv": "a,b\n1,2\n"}


@pytest.fixture(scope="module")
def compressed():
    model = tiny_models.FACTORIES["llama_gqa"]()
    return model, compress(model, "shortgpt", num_layers_to_remove=2)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, hidden ones included (relative path -> content)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _hidden(folder: Path) -> list[str]:
    """The hidden folders of saves to `folder`, beside it and inside it."""
    places = [place for place in (folder.parent, folder) if place.is_dir()]
    return sorted(p.name for place in places for p in place.iterdir() if p.name.startswith(f".{folder.name}."))


def _old_checkpoint(folder: Path) -> None:
    """A checkpoint of an earlier save (another shard layout and vocabulary), with the user's files beside it."""
    (folder / "config.json").write_text('{"model_type": "old"}')
    for i in (1, 2, 3):
        (folder / f"model-0000{i}-of-00003.safetensors").write_bytes(b"old shard")
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "vocab.txt").write_text("old vocabulary")
    for name, text in USER_FILES.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)


def _inside(path: str | os.PathLike, folder: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(folder)


@pytest.fixture
def mount_point(tmp_path, monkeypatch):
    """``tmp_path / "out"`` as a mount point: a rename between it and anywhere else fails with EXDEV (and is
    recorded), a rename within it or within its parent works."""
    out = (tmp_path / "out").resolve()
    out.mkdir()
    crossings: list[tuple[str, str]] = []

    def refusing(rename):
        def cross_device(src, dst, *args, **kwargs):
            if _inside(src, out) != _inside(dst, out):
                crossings.append((str(src), str(dst)))
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
            return rename(src, dst, *args, **kwargs)

        return cross_device

    monkeypatch.setattr(os, "rename", refusing(os.rename))
    monkeypatch.setattr(os, "replace", refusing(os.replace))
    return out, crossings


@pytest.mark.parametrize("existing", [False, True], ids=["fresh mount", "mount holding a checkpoint"])
def test_a_save_to_a_mount_point_renames_nothing_across_it(mount_point, compressed, existing):
    model, quantizer = compressed
    out, crossings = mount_point
    if existing:
        _old_checkpoint(out)

    assert quantizer.save(model, out, tiny_models.tiny_hf_tokenizer(), overwrite=existing) == out

    assert crossings == []
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    assert (out / "model.safetensors").is_file() and not (out / "vocab.txt").exists()
    assert _hidden(out) == []
    if existing:
        assert {name: (out / name).read_text() for name in USER_FILES} == USER_FILES


def _interrupt_the_card(monkeypatch, out: Path) -> type[BaseException]:
    def failing_card(_report):
        raise KeyboardInterrupt("Ctrl-C while the card is written")

    monkeypatch.setattr("optimum_flatten.export.checkpoint.render_model_card", failing_card)
    return KeyboardInterrupt


def _fail_the_last_swap(monkeypatch, out: Path) -> type[BaseException]:
    """config.json, renamed in last, is refused: every file swapped before it must go back."""
    rename = os.rename

    def failing_on_the_config(src, dst, *args, **kwargs):
        if Path(dst) == out / "config.json" and ".out.partial-" in str(src):
            raise PermissionError(errno.EACCES, "Permission denied")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing_on_the_config)
    return OutputDirectoryError


@pytest.mark.parametrize("fail", [_interrupt_the_card, _fail_the_last_swap], ids=["while writing", "while swapping"])
def test_a_failed_save_to_a_mount_point_leaves_it_as_it_was(mount_point, monkeypatch, compressed, fail):
    model, quantizer = compressed
    out, crossings = mount_point
    _old_checkpoint(out)
    before = _tree(out)
    expected = fail(monkeypatch, out)

    with pytest.raises(expected):
        quantizer.save(model, out, overwrite=True)

    assert crossings == []
    assert _tree(out) == before and _hidden(out) == []


def _read_only_by_mode(parent: Path, monkeypatch) -> None:
    parent.chmod(0o555)
    if os.access(parent, os.W_OK):
        parent.chmod(0o755)
        pytest.skip("permission bits do not bind this user (root)")


def _read_only_by_mount(parent: Path, monkeypatch) -> None:
    """Every folder made, removed or renamed directly in `parent` is refused, as on a read-only filesystem."""

    def refusing(operation):
        def read_only(*paths, **kwargs):
            if any(Path(os.path.abspath(p)).parent == parent for p in paths[:2] if isinstance(p, (str, os.PathLike))):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(paths[0]))
            return operation(*paths, **kwargs)

        return read_only

    for name in ("mkdir", "rmdir", "rename", "replace"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("make_read_only", [_read_only_by_mode, _read_only_by_mount], ids=["chmod 555", "EROFS"])
def test_a_writable_mount_under_a_read_only_parent_is_accepted(tmp_path, monkeypatch, compressed, make_read_only):
    model, quantizer = compressed
    parent = (tmp_path / "volumes").resolve()
    out = parent / "out"
    out.mkdir(parents=True)
    _old_checkpoint(out)
    try:
        make_read_only(parent, monkeypatch)
        assert check_output_dir(out, overwrite=True) == out
        assert quantizer.save(model, out, overwrite=True) == out
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
        assert {name: (out / name).read_text() for name in USER_FILES} == USER_FILES
        assert _hidden(out) == []
        # A folder that does not exist yet is made in the parent: that one is still refused before any work.
        with pytest.raises(OutputDirectoryError, match=r"'.*volumes' is not writable"):
            check_output_dir(parent / "new", overwrite=False)
    finally:
        monkeypatch.undo()
        parent.chmod(0o755)
    assert sorted(p.name for p in parent.iterdir()) == ["out"]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_inside_an_existing_output_are_removed_and_count_as_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = _dead_pid()
    staged = out / f".out.partial-{dead}-0a0a0a0a"
    (staged / "model.safetensors").parent.mkdir()
    (staged / "model.safetensors").write_bytes(b"half-written")
    # A killed save's staging folder holds nothing of the user's: the folder is still empty, no overwrite needed.
    assert check_output_dir(out, overwrite=False) == out

    backup = out / f".out.old-{dead}-0b0b0b0b"
    backup.mkdir()
    (backup / "config.json").write_text("{}")
    alive = out / f".out.partial-{os.getppid()}-0c0c0c0c"
    alive.mkdir()
    # A backup holds the old checkpoint's files: a checkpoint is there, which only overwrite replaces.
    with pytest.raises(OutputDirectoryError, match="not empty"):
        check_output_dir(out, overwrite=False)
    assert check_output_dir(out, overwrite=True) == out

    assert sorted(remove_leftovers(out)) == sorted([staged, backup])
    assert sorted(p.name for p in out.iterdir()) == [alive.name]


class FilteringApi:
    """Stands in for HfApi at its network boundary, choosing the files as the real client does: every file under
    the folder, filtered by ``allow_patterns`` / ``ignore_patterns`` with the client's own matcher."""

    def __init__(self) -> None:
        self.allow_patterns: list[str] | None = None
        self.uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
        self.allow_patterns, self.delete_patterns = allow_patterns, kwargs.get("delete_patterns")
        files = _tree(Path(folder_path))
        chosen = filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        self.uploaded = {name: files[name] for name in chosen}
        return f"https://huggingface.co/{repo_id}/commit/abc"


def test_push_uploads_only_the_files_the_save_wrote(tmp_path, compressed):
    model, quantizer = compressed
    out = tmp_path / "out"
    out.mkdir()
    _old_checkpoint(out)
    api = FilteringApi()

    quantizer.push_to_hub(model, "me/flat", tiny_models.tiny_hf_tokenizer(), local_dir=out, overwrite=True, api=api)

    assert api.allow_patterns is not None
    assert {name: (out / name).read_text() for name in USER_FILES} == USER_FILES  # kept locally, not published
    assert set(api.uploaded) == set(_tree(out)) - set(USER_FILES)
    assert {"config.json", "model.safetensors", "flatten_report.json", "README.md"} <= set(api.uploaded)
    # An earlier upload's shards and index are deleted on the Hub in the same commit (re-uploaded files are kept).
    assert {"model-*-of-*.safetensors", "model.safetensors.index.json"} <= set(api.delete_patterns)


def test_upload_patterns_match_the_checkpoint_files_and_whole_folders_and_nothing_else(tmp_path):
    (tmp_path / "additional_chat_templates" / "tools").mkdir(parents=True)
    (tmp_path / "additional_chat_templates" / "tools" / "t.jinja").write_text("{{ x }}")
    for name in ("model-00001-of-00002.safetensors", "model[1].safetensors", "config.json", "notes.env"):
        (tmp_path / name).write_text(name)

    chosen = filter_repo_objects(sorted(_tree(tmp_path)), allow_patterns=upload_patterns(tmp_path))

    expected = ["additional_chat_templates/tools/t.jinja", "config.json", "model-00001-of-00002.safetensors"]
    assert list(chosen) == expected
