"""Where a command's MODEL argument points: refused early when it cannot be a model, resolved to a folder; a run's
own state folder kept apart from its output; and a Hub push that cannot happen, refused before the work."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..utils.loading import resolve_model_source


def check_push(repo_id: str | None, private: bool) -> None:
    """Refuses, before the model loads, a ``--push-to-hub`` the Hub would refuse after the whole run (an invalid
    repo id, offline mode: `export.hub.check_hub_repo`), and ``--private`` without a push, which would otherwise
    be ignored and leave the user believing a repo was made private."""
    if private and not repo_id:
        raise ValueError("--private applies to the repo --push-to-hub creates; give --push-to-hub REPO with it.")
    if repo_id:
        from ..export.hub import check_hub_repo

        check_hub_repo(repo_id)


def check_source(name: str) -> None:
    """Refuses a model that cannot be loaded (no such folder, no or a corrupt config.json, offline and not cached)
    before anything else runs; bundled names pass (their packages are checked when they load)."""
    from ..bundled import BUNDLED_MODELS

    if name not in BUNDLED_MODELS:
        resolve_model_source(name)


def checkpoint_path(name: str) -> str:
    """A loadable checkpoint for `name`: a bundled model's converted folder (converted on first use), else the
    checked folder or Hub id, so that commands reading a path take bundled names like the others."""
    from .. import bundled

    if name in bundled.BUNDLED_MODELS:
        return str(bundled.bundled_model_path(name))
    return resolve_model_source(name)


def check_state_folder(output: str, state: str | None, option: str, sources: Sequence[str] = ()) -> None:
    """Refuses a folder where a run keeps its state (`option`: ``--resume-dir``, ``--checkpoint-dir``,
    ``--teacher-text-cache``) that is the output folder or inside it, before any work: the save would find the
    state's files there and refuse to write into a folder that holds no checkpoint, after the whole run. Refuses it
    too in a folder the run loads a model from (`sources`: the student, the dense teacher): the state would be
    written among the model's files, and `recover` ends by advising to remove the state's folder."""
    if state is None:
        return
    out, kept = Path(output).expanduser().resolve(), Path(state).expanduser().resolve()
    if kept == out or out in kept.parents:
        raise ValueError(
            f"{option} {state!r} is {'the output folder' if kept == out else 'inside the output folder'} "
            f"{output!r}, where the save must write the checkpoint alone; keep the run's state in another folder."
        )
    for source in sources:
        folder = Path(str(source)).expanduser()
        if not folder.is_dir():  # a Hub name: nothing on this disk to write into
            continue
        folder = folder.resolve()
        if kept == folder or folder in kept.parents:
            raise ValueError(
                f"{option} {state!r} is {'the folder' if kept == folder else 'inside the folder'} of the model "
                f"{str(source)!r}; keep the run's state in a folder of its own, which can be removed afterwards."
            )
