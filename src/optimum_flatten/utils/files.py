"""Writing a file so that a reader, or a run started after a kill, finds it whole under its name or not at all.

The file is written under a temporary name in the same folder (a rename within one file system is atomic), flushed to
disk, then renamed over its final name. A temporary file left by a killed writer starts with `TEMPORARY_PREFIX`, so
that a reader listing the folder can pass over it; the next write of the same file removes it (a checkpoint's weights
are gigabytes at 7B, and a job killed and resumed many times would otherwise fill the disk with them). The temporary
name carries the host, its process namespace and the process, so that only a writer known to be dead is cleaned up:
one in this process namespace whose process no longer exists, or one in another namespace of this host (another
container) whose file has gone unchanged for an hour; a folder shared between machines keeps the other hosts' files.
The file gets the permissions any new file gets (the umask's), as the files the libraries write beside it do.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

#: Prefix of the temporary names (`write_atomically`); a name with it is never a finished file.
TEMPORARY_PREFIX = ".tmp-"


#: How long another process namespace's temporary file must have gone unchanged before it counts as a dead writer's:
#: a live writer fills its file within minutes (a 70B shard), so an hour untouched is a writer that is gone.
STALE_SECONDS = 3600


def _hostname() -> str:
    """This machine's name as it can stand in a file name (letters, digits, dots, underscores; others become '_')."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def _namespace() -> str:
    """This process's PID namespace where Linux names it (``".pid<inode>"``), else ``""``: containers on one host can
    share its name (host networking) but not their process ids."""
    try:
        return f".pid{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux
        return ""


def _host() -> str:
    """The writer's host as a temporary name carries it: the host name and the process namespace."""
    return _hostname() + _namespace()


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

    A writer in this process namespace is dead when its process no longer exists. One in another namespace of this
    host (a container restarted after a kill gets a new one; a file written before names carried one has none) has
    process ids this one cannot ask about, so its file counts as left behind once it has gone `STALE_SECONDS`
    unchanged. Only POSIX can ask whether a process exists without touching it (`os.kill(pid, 0)` ends the process
    on Windows), so elsewhere nothing is removed. A file of another host is never touched.
    """
    path = Path(path)
    if os.name != "posix":
        return []
    prefix = TEMPORARY_PREFIX + _hostname()
    written = re.compile(rf"{re.escape(prefix)}(?P<namespace>(\.pid\d+)?)-(?P<pid>\d+)-{re.escape(path.name)}")
    namespace, removed = _namespace(), []
    for left in path.parent.glob(f"{glob.escape(prefix)}*-{glob.escape(path.name)}"):
        found = written.fullmatch(left.name)
        if found is None:
            continue
        pid, ours = int(found["pid"]), found["namespace"] == namespace
        if ours and pid == os.getpid():
            continue
        if not _alive(pid) if ours else _seconds_unchanged(left) >= STALE_SECONDS:
            left.unlink(missing_ok=True)
            removed.append(left)
    return removed


def _seconds_unchanged(path: Path) -> float:
    """Seconds since `path` last changed (0 when it is already gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


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
