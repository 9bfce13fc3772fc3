"""Writing a file so that a reader, or a run started after a kill, finds it whole under its name or not at all.

The file is written under a temporary name in the same folder (a rename within one file system is atomic), flushed to
disk, then renamed over its final name. A temporary file left by a killed writer starts with `TEMPORARY_PREFIX`, so
that a reader listing the folder can pass over it. The file gets the permissions any new file gets (the umask's), as
the files the libraries write beside it do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

#: Prefix of the temporary names (`write_atomically`); a name with it is never a finished file.
TEMPORARY_PREFIX = ".tmp-"


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Calls `write(temporary path)`, then flushes that file and renames it over `path`; the temporary file is removed
    if `write` fails. The folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{os.getpid()}-{path.name}")
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
