"""Saving over an existing folder: only the checkpoint is replaced, risky folders are refused, saves are atomic.

`overwrite=True` (``--overwrite``) must behave like ``save_pretrained``: replace what a checkpoint consists of and
keep every other file. Folders where even that would lose data are refused with the reason, before anything is
written or deleted. A save killed mid-way leaves hidden siblings that the next save to the same path removes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tiny_models
from common import assert_close, compress, logits, sample_ids
from optimum_flatten.cli.main import main
from optimum_flatten.export.atomic import remove_leftovers
from optimum_flatten.export.checkpoint import CHECKPOINT_PATTERNS
from optimum_flatten.utils.errors import OutputDirectoryError

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def compressed():
    model = tiny_models.FACTORIES["llama_gqa"]()
    return model, compress(model, "shortgpt", num_layers_to_remove=2)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> content): what "nothing was written or deleted" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    """The hidden folders of saves to `folder`: beside it, and inside it when it exists (`hidden_folder_parent`)."""
    places = [folder.parent, *([folder] if folder.is_dir() else [])]
    return sorted(p.name for place in places for p in place.iterdir() if p.name.startswith(f".{folder.name}."))


def _old_checkpoint(folder: Path) -> None:
    """A checkpoint from an earlier save, with files of another layout (3 shards, a WordPiece vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "old"}')
    for i in (1, 2, 3):
        (folder / f"model-0000{i}-of-00003.safetensors").write_bytes(b"old shard")
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "vocab.txt").write_text("old vocabulary")
    (folder / "README.md").write_text("old card")


def test_non_empty_checkpoint_is_refused_without_overwrite(tmp_path, compressed):
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    before = _tree(out)
    with pytest.raises(OutputDirectoryError, match=r"not empty.*overwrite=True.*other files are kept"):
        quantizer.save(model, out)
    assert _tree(out) == before and _siblings(out) == []


def test_overwrite_replaces_the_checkpoint_files_and_keeps_every_other_file(tmp_path, compressed):
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    (out / "notes.txt").write_text("keep me")
    (out / "eval").mkdir()
    (out / "eval" / "results.csv").write_text("a,b\n1,2\n")
    (out / "trainer_state.json").write_text("{}")  # a training run's state saved beside it is the user's
    (out / "modeling_custom.py").write_text("# the user's own code")

    path = quantizer.save(model, out, tiny_models.tiny_hf_tokenizer(), overwrite=True)

    assert path == out.resolve()
    names = sorted(p.name for p in out.iterdir())
    # Kept: everything that is not a checkpoint part.
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "eval" / "results.csv").read_text() == "a,b\n1,2\n"
    assert (out / "trainer_state.json").read_text() == "{}"
    assert (out / "modeling_custom.py").read_text() == "# the user's own code"
    # Replaced: the new checkpoint, with no stale shard, index or vocabulary of the old one.
    assert not [n for n in names if n.startswith("model-") or n in ("model.safetensors.index.json", "vocab.txt")]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    assert (out / "model.safetensors").is_file() and (out / "flatten_report.json").is_file()
    assert (out / "README.md").read_text() != "old card"
    assert _siblings(out) == []
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_close(logits(reloaded, sample_ids()), logits(model, sample_ids()))


def test_saving_again_to_the_folder_of_the_last_save_is_allowed(tmp_path, compressed):
    """The save records the folder as the model's name_or_path; that makes it no "source" to protect."""
    model, quantizer = compressed
    out = quantizer.save(model, tmp_path / "out")
    assert model.config._name_or_path == str(out)
    (out / "notes.txt").write_text("keep me")
    quantizer.save(model, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me" and (out / "config.json").is_file()


@pytest.mark.parametrize("case", ["current directory", "home folder", "not a checkpoint", "model source"])
def test_overwrite_refuses_folders_where_it_would_lose_data(tmp_path, monkeypatch, case, compressed):
    model, quantizer = compressed
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "data.csv").write_text("x\n1\n")
    (folder / "src").mkdir()
    (folder / "src" / "code.py").write_text("print('mine')\n")
    if case != "not a checkpoint":
        (folder / "config.json").write_text("{}")  # even a checkpoint there is refused
    output: str | Path = folder
    reason = {
        "current directory": "current working directory",
        "home folder": "home folder",
        "not a checkpoint": r"holds no checkpoint \(no config.json\)",
        "model source": "the folder the model was loaded from",
    }[case]
    if case == "current directory":
        monkeypatch.chdir(folder)
        output = "."
    elif case == "home folder":
        monkeypatch.setenv("HOME", str(folder))
    elif case == "model source":
        monkeypatch.setattr(model.config, "_name_or_path", str(folder))
    before = _tree(folder)
    with pytest.raises(OutputDirectoryError, match=f"refusing to save into .*: it is .*{reason}") as error:
        quantizer.save(model, output, overwrite=True)
    assert "\n" not in str(error.value)
    assert _tree(folder) == before and _siblings(folder) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_the_quantizers_save_refuses_the_folder_the_compressed_model_was_loaded_from(tmp_path):
    """`compress` clears the config's record of where the model came from (a LoRA trained on the result must not
    name the dense model as its base), and `FlattenQuantizer.save(..., overwrite=True)` then replaced the dense
    checkpoint with the compressed one: the folder is still refused, by the name the compression kept."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "dense"
    tiny_models.FACTORIES["llama_gqa"]().save_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    assert model.config._name_or_path == ""  # cleared, as before
    before = _tree(source)
    with pytest.raises(OutputDirectoryError, match="the folder the model was loaded from"):
        quantizer.save(model, source, overwrite=True)
    assert _tree(source) == before
    out = quantizer.save(model, tmp_path / "out")  # anywhere else, as before; then again there
    assert quantizer.save(model, out, overwrite=True) == out


def test_the_quantizers_save_refuses_a_model_its_report_does_not_describe(tmp_path, compressed):
    """The report and card are written beside the weights: a quantizer that compressed one model wrote that plan
    ("6 -> 4") beside another model's six layers, and a quantizer that compressed nothing wrote a card of question
    marks (review J). Nothing is written."""
    from optimum_flatten import FlattenQuantizer

    _, quantizer = compressed
    other = tiny_models.FACTORIES["llama_gqa"]()
    with pytest.raises(ValueError, match="is not the model this quantizer compressed"):
        quantizer.save(other, tmp_path / "other")
    with pytest.raises(ValueError, match="carries no compression report and the quantizer compressed none"):
        FlattenQuantizer(quantizer.config).save(other, tmp_path / "never")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("output", [".", "compressed"], ids=["the-source", "inside-the-source"])
def test_cli_refuses_to_overwrite_the_model_it_compresses_before_loading_it(tmp_path, capsys, monkeypatch, output):
    """The source folder itself, and (review J) a new folder inside it, which left the model's folder with a
    compressed model's folder among its files."""
    source = tmp_path / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(source)
    before = _tree(source)
    capsys.readouterr()  # the progress bar of that save

    def never_load(*args, **kwargs):
        raise AssertionError("the output folder must be checked before the model is loaded")

    monkeypatch.setattr("optimum_flatten.cli.main._load", never_load)
    data = tmp_path / "calibration.txt"
    data.write_text("\n".join(tiny_models.sample_texts()))
    args = ["compress", str(source), "--output", str(source / output), "--overwrite", "--num-layers-to-remove", "2"]
    assert main([*args, "--dataset", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: refusing to save into") and "the folder the model was loaded from" in err
    assert len(err.splitlines()) == 1
    assert _tree(source) == before


def test_an_error_during_the_save_leaves_the_old_checkpoint_and_no_trace(tmp_path, monkeypatch, compressed):
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    (out / "notes.txt").write_text("keep me")
    before = _tree(out)

    calls = []

    def failing_card(_report):
        calls.append(_report)
        raise KeyboardInterrupt("interrupted while writing")

    # Patched where the save looks it up (checkpoint's own name), and checked to have been reached.
    monkeypatch.setattr("optimum_flatten.export.checkpoint.render_model_card", failing_card)
    with pytest.raises(KeyboardInterrupt, match="interrupted while writing"):
        quantizer.save(model, out, overwrite=True)
    assert len(calls) == 1
    assert _tree(out) == before and _siblings(out) == []
    with pytest.raises(KeyboardInterrupt):
        quantizer.save(model, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_error_while_swapping_files_puts_the_old_ones_back(tmp_path, monkeypatch, compressed):
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    (out / "notes.txt").write_text("keep me")
    before = _tree(out)
    rename = Path.rename

    def rename_failing_on_the_config(self, target):
        if Path(target) == out.resolve() / "config.json" and ".out.partial-" in str(self):  # the last one moved in
            raise PermissionError(13, "Permission denied")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_failing_on_the_config)
    with pytest.raises(OutputDirectoryError, match=r"cannot replace the checkpoint files in .*out.*it is unchanged"):
        quantizer.save(model, out, overwrite=True)
    assert _tree(out) == before and _siblings(out) == []


def test_at_no_point_of_the_swap_does_a_config_stand_beside_another_saves_weights(tmp_path, monkeypatch, compressed):
    """A review killed an ``--overwrite`` save part-way through its renames: the old config.json, moved last, stood
    beside the new weights, and transformers loaded the mix without an error. Each state a kill could leave is
    either one save's files with its config, or no config (nothing loads it; the next save repairs it)."""
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    rename = Path.rename
    states = []

    def watched(self, target):
        moved = rename(self, target)
        config = out / "config.json"
        saves = (
            ("old" if json.loads(config.read_text()).get("model_type") == "old" else "new")
            if config.is_file()
            else None
        )
        new, old = (out / "model.safetensors").is_file(), (out / "model-00001-of-00003.safetensors").is_file()
        states.append((saves, new, old))
        return moved

    monkeypatch.setattr(Path, "rename", watched)
    quantizer.save(model, out, overwrite=True)
    assert states[-1] == ("new", True, False)
    assert all(saves is None or (saves, new, old) in {("old", False, True), ("new", True, False)}
               for saves, new, old in states), states  # fmt: skip


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import tiny_models
    from common import compress

    class SlowTokenizer(tiny_models.CharTokenizer):
        # Called after the weights are in the staging folder: say so, then hang until killed.
        def save_pretrained(self, directory):
            Path(sys.argv[3]).write_text(str(directory))
            time.sleep(600)

    model = tiny_models.tiny_llama_gqa()
    quantizer = compress(model, "shortgpt", num_layers_to_remove=2)
    quantizer.save(model, sys.argv[2], SlowTokenizer(), overwrite=True)
    """
)


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "existing checkpoint"])
def test_a_save_killed_with_sigkill_is_cleaned_up_by_the_next_save(tmp_path, existing, compressed):
    out = tmp_path / "out"
    if existing:
        _old_checkpoint(out)
        (out / "notes.txt").write_text("keep me")
    before = _tree(out) if existing else None
    flag = tmp_path / "writing"
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, str(script), str(TESTS), str(out), str(flag)], env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not flag.exists():
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the save in the subprocess never reached the tokenizer"
            time.sleep(0.1)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    staging = Path(flag.read_text())
    # The kill left the hidden staging folder with the weights in it, and the output as it was.
    assert staging.name.startswith(".out.partial-") and (staging / "model.safetensors").is_file()
    assert _siblings(out) == [staging.name]
    assert staging.parent == (out if existing else tmp_path)  # inside an existing output: one filesystem
    ours = {k: v for k, v in _tree(out).items() if not k.startswith(".out.")} if existing else None
    assert (ours == before) if existing else not out.exists()
    # A leftover of a save that is still running (its process is alive) is not touched.
    alive = tmp_path / f".out.partial-{os.getppid()}-0a0a0a0a"
    alive.mkdir()

    model, quantizer = compressed
    quantizer.save(model, out, overwrite=True)
    assert _siblings(out) == [alive.name]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    if existing:
        assert (out / "notes.txt").read_text() == "keep me"


def test_leftovers_of_a_kill_during_the_swap_are_removed(tmp_path):
    out = tmp_path / "run[1]"  # glob characters in the name are literal
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f".run[1].old-{dead.pid}-0b0b0b0b"
    old.mkdir()
    (old / "config.json").write_text("{}")
    legacy = tmp_path / ".run[1].partial-k3j4h5"  # the layout before process ids were recorded
    legacy.mkdir()
    other = tmp_path / ".run2.partial-1-0c0c0c0c"  # another output's
    other.mkdir()
    assert sorted(remove_leftovers(out)) == sorted([old, legacy])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run2.partial-1-0c0c0c0c", "run[1]"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_folder_and_files_follow_the_umask(tmp_path, umask, compressed):
    model, quantizer = compressed
    previous = os.umask(umask)
    try:
        out = quantizer.save(model, tmp_path / "nested" / "out", tiny_models.CharTokenizer())
    finally:
        os.umask(previous)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # 0755 under 022, as save_pretrained
    assert ((out.parent).stat().st_mode & 0o777) == 0o777 & ~umask
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_every_file_a_save_writes_is_a_checkpoint_part(tmp_path, compressed):
    """What the writer writes is what `overwrite` replaces and what stale removal knows about."""
    import fnmatch

    model, quantizer = compressed
    out = quantizer.save(model, tmp_path / "out", tiny_models.tiny_hf_tokenizer())
    for name in (p.name for p in out.iterdir()):
        assert any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_PATTERNS), name


def _disk_full_oserror(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full_safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )


@pytest.mark.parametrize("fail", [_disk_full_oserror, _disk_full_safetensors])
def test_a_full_disk_is_one_line_and_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch, capsys, fail, compressed):
    """The write of the weights raises as a full disk does (as OSError(ENOSPC), and as safetensors reports it: its
    own error with the OS message as text); the CLI answers in one line with exit 2, and the checkpoint that was in
    the folder is byte for byte what it was, with no hidden sibling left."""
    model, quantizer = compressed
    out = tmp_path / "out"
    _old_checkpoint(out)
    (out / "notes.txt").write_text("keep me")
    before = _tree(out)
    source = tmp_path / "source"
    model.save_pretrained(source)
    tiny_models.tiny_hf_tokenizer().save_pretrained(source)
    data = tmp_path / "text.txt"
    data.write_text("\n".join(tiny_models.sample_texts(60)))
    calls = []

    def full(*args, **kwargs):
        calls.append(args)
        fail()

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full)
    with pytest.raises(OutputDirectoryError, match=r"disk filled up .* the checkpoint already in .* is intact"):
        quantizer.save(model, out, overwrite=True)
    assert calls and _tree(out) == before and _siblings(out) == []
    with pytest.raises(OutputDirectoryError, match=r"nothing was written to .* needs about [0-9.]+ GiB"):
        quantizer.save(model, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists() and _siblings(tmp_path / "fresh") == []

    argv = [
        "compress",
        str(source),
        "--method",
        "shortgpt",
        "--num-layers-to-remove",
        "1",
        "--dataset",
        str(data),
        "--nsamples",
        "4",
        "--seqlen",
        "32",
        "--no-progress",
        "--output",
        str(out),
        "--overwrite",
    ]
    capsys.readouterr()
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%" not in line]
    assert len(err) == 1 and err[0].startswith("error: the disk filled up") and "is intact" in err[0], err
    assert _tree(out) == before and _siblings(out) == []


def test_another_ranks_write_probe_does_not_make_an_empty_folder_look_full(tmp_path):
    """Under torchrun each rank tries the output folder's write access with a probe folder it removes at once
    (`atomic.check_writable`); the other rank, checking the same empty folder (a mount point) at that moment, saw a
    folder that is not empty and holds no checkpoint, and refused while the first went on into its collectives."""
    from optimum_flatten.export.checkpoint import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / ".out.probe-k3j4h5ab").mkdir()  # another rank's, between its mkdtemp and its rmdir
    assert check_output_dir(out, overwrite=False) == out
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(OutputDirectoryError, match="not empty"):
        check_output_dir(out, overwrite=False)
