"""`utils.files.write_atomically`: a file is whole under its name or absent, with a new file's usual permissions."""

from __future__ import annotations

import os
import stat
import time

import pytest

from optimum_flatten.utils.files import TEMPORARY_PREFIX, write_atomically, write_bytes_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_bytes_atomically(target, b"old")

    def broken(temporary):
        temporary.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, broken)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_file_gets_the_permissions_of_a_plain_new_file(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    write_bytes_atomically(tmp_path / "sub" / "atomic", b"x")  # the folder is created too
    mode = stat.S_IMODE(os.stat(tmp_path / "sub" / "atomic").st_mode)
    assert mode == stat.S_IMODE(os.stat(plain).st_mode)
    assert not any(p.name.startswith(TEMPORARY_PREFIX) for p in (tmp_path / "sub").iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_writer_that_makes_its_file_private_gets_the_plain_mode_back(tmp_path, umask):
    """safetensors writes 0600 whatever the umask: the teacher-text cache's rows were unreadable beside its 0644
    keys."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        plain = tmp_path / "plain"
        plain.write_bytes(b"x")
        rows = tmp_path / "rows.safetensors"
        write_atomically(rows, lambda path: save_file({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, str(path)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(rows).st_mode) == stat.S_IMODE(os.stat(plain).st_mode) == 0o666 & ~umask


def _dead_pid() -> int:
    """The pid of a process that has ended (a child started and waited for)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write_and_no_other(tmp_path):
    """A job killed mid-write and resumed left `.tmp-…` files (gigabytes a checkpoint at 7B) that nothing removed.
    Only this host's dead writers of the same file are cleaned up: a live writer's file, another host's (a shared
    folder) and another file's stay."""
    from optimum_flatten.utils import files

    target = tmp_path / "model.safetensors"
    host = files._host()
    dead = tmp_path / f"{TEMPORARY_PREFIX}{host}-{_dead_pid()}-model.safetensors"
    live = tmp_path / f"{TEMPORARY_PREFIX}{host}-{os.getppid()}-model.safetensors"
    elsewhere = tmp_path / f"{TEMPORARY_PREFIX}other-host-{_dead_pid()}-model.safetensors"
    other_file = tmp_path / f"{TEMPORARY_PREFIX}{host}-{_dead_pid()}-state.json"
    # Another process namespace of this host (a container under the host's name, a restarted one, or a name written
    # before names carried one): its pids are not ours to ask about, so only a file unchanged for an hour goes.
    name = files._hostname()
    container, restarted = (tmp_path / f"{TEMPORARY_PREFIX}{name}.pid{n}-{_dead_pid()}-model.safetensors" for n in "12")
    unnamed = tmp_path / f"{TEMPORARY_PREFIX}{name}-{_dead_pid()}-model.safetensors"
    kept = (live, elsewhere, other_file, container)
    for left in (dead, restarted, unnamed, *kept):
        left.write_bytes(b"half")
    hours_ago = time.time() - files.STALE_SECONDS - 60
    for left in (restarted, unnamed):
        os.utime(left, (hours_ago, hours_ago))

    write_bytes_atomically(target, b"whole")

    assert target.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (target, *kept))


def test_the_temporary_name_says_host_and_process(tmp_path, monkeypatch):
    from optimum_flatten.utils import files

    monkeypatch.setattr(files.socket, "gethostname", lambda: "node/7 a")
    seen = []
    write_atomically(tmp_path / "x", lambda temporary: (seen.append(temporary.name), temporary.write_bytes(b"x")))
    namespace = f".pid{os.stat('/proc/self/ns/pid').st_ino}" if os.path.exists("/proc/self/ns/pid") else ""
    assert seen == [f"{TEMPORARY_PREFIX}node_7_a{namespace}-{os.getpid()}-x"]
