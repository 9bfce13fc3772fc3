"""The folders a run keeps its state in (a compression's resume folder, a healing's checkpoints, the teacher's
sampled rows), kept apart from the output folder and the model folders before any work: a save refuses a folder that
holds another run's files, and a state folder is removed once the run is over."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The keys of ``FlattenConfig(heal=...)`` that name a folder a healing keeps its state in, with the flag of
#: `compress` that sets each (None: the API only).
HEAL_STATE_FOLDERS = {"checkpoint_dir": "--heal-checkpoint-dir", "teacher_text_cache": None}


def check_state_folder(
    output: str, state: str | None, option: str, sources: Sequence[str] = (), removed_after: bool = False
) -> None:
    """Refuses a folder where a run keeps its state (`option`: ``--resume-dir``, ``--checkpoint-dir``,
    ``--teacher-text-cache``) that is the output folder or inside it, before any work: the save would find the
    state's files there and refuse to write into a folder that holds no checkpoint, after the whole run. Refuses it
    too in a folder the run loads a model from (`sources`: the student, the dense teacher): the state would be
    written among the model's files, and `recover` ends by advising to remove the state's folder. With
    `removed_after` (a healing's checkpoint folder, which the command advises removing once the model is saved) it
    refuses an output inside the state's folder too; a resume folder or a teacher-text cache may hold it."""
    if state is None:
        return
    out, kept = Path(output).expanduser().resolve(), Path(state).expanduser().resolve()
    if kept == out or out in kept.parents:
        raise ValueError(
            f"{option} {state!r} is {'the output folder' if kept == out else 'inside the output folder'} "
            f"{output!r}, where the save must write the checkpoint alone; keep the run's state in another folder."
        )
    if removed_after and kept in out.parents:
        raise ValueError(
            f"the output folder {output!r} is inside {option} {state!r}, which is removed once the run is over; "
            "save the model outside the run's state folder."
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


def check_heal_folders(
    output: str, heal: Mapping[str, Any] | None, sources: Sequence[str] = (), command_line: bool = False
) -> None:
    """`check_state_folder` for the folders of a compression's healing (``FlattenConfig(heal=...)``): both the
    command line's ``compress --heal-tokens`` and ``FlattenQuantizer.quantize(save_dir)`` save after the whole
    compression and healing, so a state folder inside the output must be refused before them; named by the flag on
    the command line, by the heal key in the API."""
    for key, flag in HEAL_STATE_FOLDERS.items():
        option = flag if command_line and flag else f"heal[{key!r}]"
        check_state_folder(output, (heal or {}).get(key), option, sources, removed_after=key == "checkpoint_dir")
