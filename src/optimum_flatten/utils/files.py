"""Writing a file so that a reader, or a run started after a kill, finds it whole under its name or not at all.

The file is written under a temporary name in the same folder (a rename within one file system is atomic), flushed to
disk, then renamed over its final name. A temporary file left by a killed writer starts with `TEMPORARY_PREFIX`, so
that a reader listing the folder can pass over it; the next write of the same file removes it (a checkpoint's weights
are gigabytes at 7B, and a job killed and resumed many times would otherwise fill the disk with them). The temporary
name carries the host (and its process namespace) and the process, so that only a writer known to be dead is cleaned
up: one on this host whose process no longer exists; a folder shared between machines, or containers, keeps the
others' files. The file gets the
permissions any new file gets (the umask's), as the files the libraries write beside it do.
"""

from __future__ import annotations

import glob
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

#: Prefix of the temporary names (`write_atomically`); a name with it is never a finished file.
TEMPORARY_PREFIX = ".tmp-"


def _host() -> str:
    """This machine's name as it can stand in a file name (letters, digits, dots, underscores; others become '_'),
    with, where Linux names it, the process namespace: containers on one host can share its name (host networking)
    but not their process ids, so another container's live writer must not look like a dead one of ours."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"
    try:
        return f"{name}.pid{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux
        return name


def _temporary(path: Path) -> Path:
    return path.with_name(f"{TEMPORARY_PREFIX}{_host()}-{os.getpid()}-{path.name}")


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_dead_writers(path: str | os.PathLike[str]) -> list[Path]:
    """Removes the temporary files that writers of `path` on this host left when they were killed; returns them.

    Only POSIX can ask whether a process exists without touching it (`os.kill(pid, 0)` ends the process on Windows),
    so elsewhere nothing is removed. A file of a live process, or of another host, is never touched.
    """
    path = Path(path)
    if os.name != "posix":
        return []
    prefix = f"{TEMPORARY_PREFIX}{_host()}-"
    removed = []
    for left in path.parent.glob(f"{glob.escape(prefix)}*-{glob.escape(path.name)}"):
        pid = left.name[len(prefix) : -len(path.name) - 1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            left.unlink(missing_ok=True)
            removed.append(left)
    return removed


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Calls `write(temporary path)`, then flushes that file and renames it over `path`; the temporary file is removed
    if `write` fails, and those that killed writers of `path` on this host left are removed first. The folder is
    created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers(path)
    temporary = _temporary(path)
    try:
        # The mode a new file gets here (0644 under umask 022): safetensors writes its own file 0600 and renames it
        # in, which made the teacher-text cache's rows unreadable to the group that could read its keys.
        temporary.touch()
        mode = temporary.stat().st_mode & 0o777
        write(temporary)
        if temporary.stat().st_mode & 0o777 != mode:
            temporary.chmod(mode)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def write_bytes_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """`data` written to `path` by `write_atomically`."""
    write_atomically(path, lambda temporary: temporary.write_bytes(data))
