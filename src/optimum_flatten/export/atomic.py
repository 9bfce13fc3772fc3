"""Writing a folder so that it appears complete or not at all, without a rename that leaves its filesystem.

A save writes into a hidden folder (``.NAME.partial-PID-HEX``) and then renames it into place; over an existing
folder, the files it replaces are renamed into another hidden folder (``.NAME.old-PID-HEX``) and back on an error.
Both hidden folders are made where every rename stays on the output's filesystem (`hidden_folder_parent`): beside a
new output folder, inside an existing one. An existing output folder may be a mount point (a Docker ``-v`` volume, a
Kubernetes PVC) whose parent is another filesystem, often read-only: a rename from there fails with "Invalid
cross-device link", and only after the whole compression ran. Nothing here knows what a checkpoint is:
`move_into_place` is told which existing files are the writer's to replace. `export.checkpoint` uses it for
compressed checkpoints.
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

#: Hidden folders of a save to an output folder NAME: ``.NAME.partial-PID-HEX`` (a save being written) and
#: ``.NAME.old-PID-HEX`` (the replaced files while they are swapped), beside a new output folder or inside an
#: existing one. A save killed mid-way leaves them; the next save removes those whose process is gone.
STAGING, BACKUP = "partial", "old"
#: The folder `check_writable` makes and removes at once to try a folder's write access.
PROBE = "probe"


def hidden_folder_parent(path: Path) -> Path:
    """Where a save to `path` makes its hidden folders: inside `path` when it is an existing folder, else beside it.

    Inside an existing folder every rename of the save (staged file in, replaced file out and back) stays in that
    folder, so on its filesystem even when `path` is a mount point; beside a new one, the one rename (the staging
    folder becoming `path`) stays in the parent, which is where `path` is created.
    """
    return path if path.is_dir() else path.parent


def check_writable(path: Path) -> None:
    """Refuses an output path the save could not write, so that it is found before the compression runs.

    Tried where the save writes (`hidden_folder_parent`): inside an existing folder, which may be a writable mount
    under a read-only parent, or else in the nearest existing ancestor of a new one (the save creates the missing
    folders). A probe folder is made and removed at once: permission bits alone do not tell (root ignores them; a
    read-only mount or an ACL refuses anyway).

    Raises:
        OutputDirectoryError: naming the folder that cannot be written and what to do.
    """
    import tempfile

    folder = nearest_existing_folder(path)
    if not folder.is_dir():
        raise OutputDirectoryError(
            f"cannot create the output folder {str(path)!r}: {str(folder)!r} is a file; choose another path."
        )
    try:
        probe = tempfile.mkdtemp(prefix=f".{path.name or 'output'}.{PROBE}-", dir=folder)
    except OSError as error:
        raise OutputDirectoryError(
            f"cannot write the output folder {str(path)!r}: {str(folder)!r} is not writable "
            f"({error.strerror or error}); choose an output folder where you can write, or fix the permissions."
        ) from error
    os.rmdir(probe)


def nearest_existing_folder(path: Path) -> Path:
    """`path` when it is an existing folder, else its nearest existing ancestor: where the save's files land first,
    so the folder whose permissions and free space count (it may be a file, which `check_writable` refuses)."""
    if path.is_dir():
        return path
    ancestor = path.parent if str(path.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    return ancestor


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

    The save writes into a hidden folder first and removed it on the error, so the folder is exactly as it was:
    the checkpoint that was there is intact, or nothing was written. The free space is that of the filesystem the
    save writes to (the output folder itself when it exists: a mount point has its own).
    """
    free = shutil.disk_usage(nearest_existing_folder(path)).free
    state = f"the checkpoint already in {str(path)!r} is intact" if existed else f"nothing was written to {str(path)!r}"
    return (
        f"the disk filled up while the checkpoint was written (No space left on device); {state}. The new "
        f"checkpoint needs about {needed / 2**30:.2f} GiB of free space on its disk ({free / 2**30:.2f} GiB free "
        "now): free that much, or pass an --output on another disk, and save again."
    )


def remove_leftovers(path: str | Path) -> list[Path]:
    """Removes the hidden ``.NAME.partial-*`` / ``.NAME.old-*`` folders that saves to `path` killed mid-way left
    (beside `path` or inside it, see `hidden_folder_parent`).

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
    """The hidden ``.NAME.KIND-*`` folders of saves to `path`, in both places a save makes them: beside `path` (it
    was new then) and inside it (it existed)."""
    pattern = f".{glob_escape(path.name)}.{kind}-*"
    places = [place for place in dict.fromkeys((path.parent, path)) if place.is_dir()]
    return sorted(p for place in places for p in place.glob(pattern) if p.is_dir())


def is_hidden_folder(path: Path, name: str) -> bool:
    """Whether `name`, found inside `path`, is a hidden folder of a save to `path` (never a checkpoint file)."""
    return re.fullmatch(rf"\.{re.escape(path.name)}\.(?:{STAGING}|{BACKUP})-.*", name) is not None


def glob_escape(name: str) -> str:
    """`name` with the glob metacharacters made literal (an output folder may be called ``run[1]``)."""
    return re.sub(r"([*?[])", r"[\1]", name)


def _owner_alive(name: str) -> bool:
    """Whether the process that made the hidden folder `name` (``.NAME.KIND-PID-HEX``) still runs."""
    match = re.search(r"\.(?:partial|old)-(\d+)-[0-9a-f]+$", name)
    if match is None or os.name != "posix":  # an older layout, or no signal 0 to ask with
        return False
    pid = int(match.group(1))
    if pid == os.getpid():
        return False  # this process runs one save at a time per path: a folder of ours is an old failure
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def make_hidden_folder(path: Path, kind: str) -> Path:
    """Creates the hidden folder ``.NAME.KIND-PID-HEX`` of a save to `path` where its renames stay on one filesystem
    (`hidden_folder_parent`), with the umask's mode (0755 under 022): it becomes the output folder itself when `path`
    is new, and a save_pretrained folder has that mode."""
    parent = hidden_folder_parent(path)
    while True:
        folder = parent / f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir(mode=0o777)
            return folder
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

    A new `path` is `staging` renamed: it appears complete or not at all. In an existing one the old config.json is
    moved to a hidden backup first, then each checkpoint file, each new one renamed in, and the new config.json last:
    a process killed part-way leaves a folder with no config (which nothing loads, and the next save repairs), never
    one config beside another save's weights (which transformers loaded without an error); an error puts the old
    files back. Existing files the save does not write are removed when
    `replaceable(name)` says they are the writer's (they would describe another model); every other file is kept.
    The backup is made inside `path` (`make_hidden_folder`), as `staging` was, so no rename leaves its filesystem.
    """
    if not path.exists():
        staging.rename(path)
        return
    new = sorted(p.name for p in staging.iterdir())
    new.sort(key=lambda name: name == "config.json")  # a reader (or the next save) keeps finding a config.json
    stale = sorted(
        p.name
        for p in path.iterdir()
        if p.name not in new and not is_hidden_folder(path, p.name) and replaceable(p.name)
    )
    try:
        backup = make_hidden_folder(path, BACKUP)
    except OSError as error:
        raise OutputDirectoryError(f"cannot write in {str(path)!r}: {error.strerror or error}.") from error
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in [name for name in ("config.json",) if name in new] + stale + new:
            if name not in moved_out and ((path / name).exists() or (path / name).is_symlink()):
                (path / name).rename(backup / name)
                moved_out.append(name)
        for name in new:
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
