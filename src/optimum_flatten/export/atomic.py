"""Writing a folder so that it appears complete or not at all, beside the folder it replaces.

A save writes into a hidden sibling (``.NAME.partial-PID-HEX``) and then renames it into place; over an existing
folder, the files it replaces are renamed into another sibling (``.NAME.old-PID-HEX``) and back on an error. Nothing
here knows what a checkpoint is: `move_into_place` is told which existing files are the writer's to replace.
`export.checkpoint` uses it for compressed checkpoints.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from ..utils.errors import OutputDirectoryError

logger = logging.getLogger(__name__)

#: Hidden siblings of an output folder: ``.NAME.partial-PID-HEX`` (a save being written) and ``.NAME.old-PID-HEX``
#: (the replaced files while they are swapped). A save killed mid-way leaves them; the next save removes those
#: whose process is gone.
STAGING, BACKUP = "partial", "old"


def check_writable(path: Path) -> None:
    """Refuses an output path the save could not write, so that it is found before the compression runs.

    The save writes a hidden sibling of `path` (in its parent, created if missing) and, over an existing folder,
    renames files inside `path`. Both are tried with a probe folder made and removed at once: permission bits alone
    do not tell (root ignores them; a read-only mount or an ACL refuses anyway).

    Raises:
        OutputDirectoryError: naming the folder that cannot be written and what to do.
    """
    import tempfile

    ancestor = path.parent if str(path.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirectoryError(
            f"cannot create the output folder {str(path)!r}: {str(ancestor)!r} is a file; choose another path."
        )
    for folder in (ancestor, path) if path.is_dir() else (ancestor,):
        try:
            probe = tempfile.mkdtemp(prefix=f".{path.name or 'output'}.probe-", dir=folder)
        except OSError as error:
            raise OutputDirectoryError(
                f"cannot write the output folder {str(path)!r}: {str(folder)!r} is not writable "
                f"({error.strerror or error}); choose an output folder where you can write, or fix the permissions."
            ) from error
        os.rmdir(probe)


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` says the disk filled up: an OSError with ENOSPC (or EDQUOT, a full quota), or the
    safetensors library's own error, which carries the OS message as text rather than an errno."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, SafetensorError) and (
        "No space left on device" in str(error) or "os error 28" in str(error)
    )


def disk_full_message(path: Path, needed: int, existed: bool) -> str:
    """One line for a save that ran out of space: what happened, what is on disk now, and how much to free.

    The save writes into a hidden sibling first and removed it on the error, so the folder is exactly as it was:
    the checkpoint that was there is intact, or nothing was written.
    """
    free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    state = f"the checkpoint already in {str(path)!r} is intact" if existed else f"nothing was written to {str(path)!r}"
    return (
        f"the disk filled up while the checkpoint was written (No space left on device); {state}. The new "
        f"checkpoint needs about {needed / 2**30:.2f} GiB of free space beside it ({free / 2**30:.2f} GiB free "
        "now): free that much, or pass an --output on another disk, and save again."
    )


def remove_leftovers(path: str | Path) -> list[Path]:
    """Removes the hidden ``.NAME.partial-*`` / ``.NAME.old-*`` siblings that saves to `path` killed mid-way left.

    Those of a save still running (its process is alive) are kept. Returns what was removed (also logged: a killed
    save of a large model leaves gigabytes).
    """
    path = Path(path)
    removed = []
    for leftover in leftovers(path, STAGING) + leftovers(path, BACKUP):
        if _owner_alive(leftover.name):
            continue
        shutil.rmtree(leftover, ignore_errors=True)
        if not leftover.exists():
            removed.append(leftover)
    if removed:
        logger.warning("removed leftovers of an interrupted save to %s: %s", path, ", ".join(p.name for p in removed))
    return removed


def leftovers(path: Path, kind: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.glob(f".{glob_escape(path.name)}.{kind}-*") if p.is_dir())


def glob_escape(name: str) -> str:
    """`name` with the glob metacharacters made literal (an output folder may be called ``run[1]``)."""
    return re.sub(r"([*?[])", r"[\1]", name)


def _owner_alive(name: str) -> bool:
    """Whether the process that made the hidden sibling `name` (``.NAME.KIND-PID-HEX``) still runs."""
    match = re.search(r"\.(?:partial|old)-(\d+)-[0-9a-f]+$", name)
    if match is None or os.name != "posix":  # an older layout, or no signal 0 to ask with
        return False
    pid = int(match.group(1))
    if pid == os.getpid():
        return False  # this process runs one save at a time per path: a sibling of ours is an old failure
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def make_sibling(path: Path, kind: str) -> Path:
    """Creates the hidden folder ``.NAME.KIND-PID-HEX`` next to `path`, with the umask's mode (0755 under 022):
    it becomes the output folder itself when `path` is new, and a save_pretrained folder has that mode."""
    while True:
        sibling = path.parent / f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            sibling.mkdir(mode=0o777)
            return sibling
        except FileExistsError:
            continue


def follow_umask(staging: Path) -> None:
    """Gives every file and folder of the save the mode the umask gives a new one (0644 / 0755 under 022).

    safetensors 0.8 writes its files 0600 (through a private temporary file), which would make the weights the one
    unreadable part of a shared checkpoint. `staging` was made with mkdir(0777), so its mode is the umask's answer.
    """
    allowed = staging.stat().st_mode & 0o777
    for item in staging.rglob("*"):
        if item.is_symlink():
            continue
        mode = item.stat().st_mode & 0o777
        wanted = allowed if item.is_dir() else (0o666 | (mode & 0o111)) & allowed
        if mode != wanted:
            item.chmod(wanted)


def move_into_place(staging: Path, path: Path, replaceable: Callable[[str], bool]) -> None:
    """Makes the written checkpoint in `staging` the content of `path`, keeping `path`'s other files.

    A new `path` is `staging` renamed: it appears complete or not at all. In an existing one each checkpoint file is
    moved to a hidden backup and the new one renamed in, config.json last so that the folder keeps a config while
    files are swapped; an error puts the old files back. Existing files the save does not write are removed when
    `replaceable(name)` says they are the writer's (they would describe another model); every other file is kept.
    """
    if not path.exists():
        staging.rename(path)
        return
    new = sorted(p.name for p in staging.iterdir())
    new.sort(key=lambda name: name == "config.json")  # a reader (or the next save) keeps finding a config.json
    stale = sorted(p.name for p in path.iterdir() if p.name not in new and replaceable(p.name))
    try:
        backup = make_sibling(path, BACKUP)
    except OSError as error:
        raise OutputDirectoryError(f"cannot write next to {str(path)!r}: {error.strerror or error}.") from error
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in stale:
            (path / name).rename(backup / name)
            moved_out.append(name)
        for name in new:
            if (path / name).exists() or (path / name).is_symlink():
                (path / name).rename(backup / name)
                moved_out.append(name)
            (staging / name).rename(path / name)
            moved_in.append(name)
    except BaseException as error:
        for name in reversed(moved_in):
            (path / name).rename(staging / name)
        for name in reversed(moved_out):
            (backup / name).rename(path / name)
        backup.rmdir()
        if isinstance(error, OSError):
            raise OutputDirectoryError(
                f"cannot replace the checkpoint files in {str(path)!r} ({error.strerror or error}); it is unchanged."
            ) from error
        raise
    shutil.rmtree(backup, ignore_errors=True)
    staging.rmdir()
