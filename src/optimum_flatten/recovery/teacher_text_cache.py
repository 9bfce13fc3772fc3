"""The teacher's sampled rows kept on disk (`recovery.teacher_text`): what they depend on (the key), and writing and
reading them back, so that a resumed healing does not sample again and another key samples again.

One job apart from the sampling itself: the key is JSON beside a safetensors file of the rows, whose metadata keeps
what sampling them cost; the rows are written first and the key last, each atomically, so a key always names
complete rows. While a sampling runs, each process also keeps the rows of its finished batches (`FinishedBatches`), so
that a sampling stopped part-way (a pre-empted job, a session's end) goes on from its next batch instead of from
the first: each batch draws from its own seed (`teacher_text.batch_seed`), so at the same batch size the rows come
out as if it never stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..utils.differences import describe_differences
from ..utils.files import write_atomically, write_bytes_atomically

logger = logging.getLogger(__name__)


def cache_key(
    teacher: nn.Module, tokenizer: Any, n_rows: int, seqlen: int, settings: dict[str, Any], prompts: Any
) -> dict[str, Any]:
    """What the cached rows depend on: the teacher (its weights' fingerprint and name, `teacher_name`), the
    vocabulary, the rows' count and length, and the sampling settings and prompts (hashed)."""
    from ..utils.fingerprint import weights_fingerprint

    return {
        "teacher": teacher_name(teacher),
        "teacher_fingerprint": weights_fingerprint(teacher),
        "vocab_size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
        "n_rows": int(n_rows),
        "seqlen": int(seqlen),
        **settings,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest() if prompts else None,
    }


def teacher_name(teacher: nn.Module) -> str:
    """The teacher's name in the key: its config's ``_name_or_path``, a local folder resolved to its absolute path.

    The name stays beside the fingerprint because the fingerprint samples the first values of each tensor only
    (`utils.fingerprint`), so two checkpoints differing past them would share it; but one folder spelled another way
    (relative, absolute, a trailing slash, through a link) holds the same weights and must hit the same cache. A hub
    id (no such folder here) is kept as written."""
    name = str(getattr(getattr(teacher, "config", None), "_name_or_path", "") or "")
    if name and os.path.isdir(name):
        return str(Path(name).resolve())
    return name


def read_cache(folder: Path, name: str, key: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any] | None] | None:
    """The cached rows and what sampling them cost (None in a cache written before that was kept) when the folder
    holds them under the same key, else None."""
    key_path, rows_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not rows_path.is_file():
        return None
    saved = _read_key(key_path)
    if saved is None:
        return None
    if saved != _as_read_back(key):
        logger.info("teacher text cache %s: another key, sampling again", key_path)
        return None
    ids, metadata = _read_rows(rows_path)
    if "key" in metadata and json.loads(metadata["key"]) != saved:  # rows of another run beside this key
        logger.info(
            "teacher text cache %s: rows of another key (a run stopped while writing), sampling again", rows_path
        )
        return None
    if tuple(ids.shape) != (key["n_rows"], key["seqlen"]):
        return None
    return ids, json.loads(metadata["sampling"]) if "sampling" in metadata else None


class OtherJobsRows(ValueError):
    """`check_one_job`'s refusal: `folder` holds rows of `name` sampled under the key `saved`, not `now`. The keys are
    kept so that a caller whose options count otherwise (a calibration row's seqlen is the user's without its start
    token) can name the difference in its user's terms."""

    def __init__(self, folder: Path, name: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
        self.folder, self.name, self.saved, self.now = folder, name, saved, now
        super().__init__(
            f"{folder} holds the {name} rows another job sampled ({describe_differences(saved, now)}); rerun with the "
            "options that job was started with, or give another folder (nothing was changed)."
        )


def check_one_job(folder: Path, name: str, key: dict[str, Any]) -> None:
    """Refuses, before anything is sampled, a folder that holds one job's rows of `name` (complete, or a stopped
    sampling's finished batches) under another key, naming what differs (`OtherJobsRows`); nothing in it is changed.

    Why: a resume folder (compress's ``resume_dir``, recover's ``checkpoint_dir``) holds one job, and rows sampled
    under another key there would be written over the rows the interrupted job needs (hours of sampling at 7B), only
    for that folder's own check to refuse the new job afterwards."""
    saved, now = _saved_key(folder, name), _as_read_back(key)
    if saved is not None and describe_differences(saved, now):
        raise OtherJobsRows(folder, name, saved, now)


def _saved_key(folder: Path, name: str) -> dict[str, Any] | None:
    """The key of the rows of `name` kept in `folder`: the complete rows', else a stopped sampling's (None: none)."""
    key_path = folder / f"{name}.json"
    if key_path.is_file():
        return _read_key(key_path)
    for partial in sorted(folder.glob(f"{name}.partial-rank*.safetensors")):
        identity = _read_rows(partial, with_rows=False)[1].get("identity")
        if identity:
            return json.loads(identity)["key"]
    return None


def _as_read_back(key: dict[str, Any]) -> dict[str, Any]:
    """`key` as its JSON reads back (tuples as lists, keys as strings): what a saved key is compared with."""
    return json.loads(json.dumps(key))


def _read_key(path: Path) -> dict[str, Any] | None:
    """The key JSON at `path`; None when it is missing or unreadable (a key is written atomically, last: an
    unreadable one names no complete rows)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None


def _read_rows(path: Path, with_rows: bool = True) -> tuple[torch.Tensor | None, dict[str, str]]:
    """(the rows, the file's metadata) of a rows file: the cache's or a stopped sampling's finished batches; the
    rows left unread where only the metadata is asked (it sits in the file's header)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as rows:
        return (rows.get_tensor("input_ids") if with_rows else None), rows.metadata() or {}


def write_cache(folder: Path, name: str, key: dict[str, Any], ids: torch.Tensor, sampling: dict[str, Any]) -> None:
    """The rows with what sampling them cost and their key (in the file's metadata: a healing resumed from the cache
    still reports the generation's seconds and memory, and rows are never read under another run's key), then the
    key beside them (written last: a key names complete rows), each atomically."""
    from safetensors.torch import save_file

    metadata = {"sampling": json.dumps(sampling), "key": json.dumps(key, sort_keys=True)}
    write_atomically(
        folder / f"{name}.safetensors", lambda path: save_file({"input_ids": ids.contiguous()}, str(path), metadata)
    )
    write_bytes_atomically(folder / f"{name}.json", json.dumps(key, indent=1, sort_keys=True).encode())


@dataclass
class FinishedBatches:
    """One process's finished batches of a sampling in progress, kept beside the cache (`open`): the rows a stopped
    sampling left (None: none), kept again after each batch (`save`) and removed once the cache holds them all
    (`clear`). A batch's rows and seed are fixed by its index, its size and the process's share of the rows, so they
    are read back only under the same key, rank and world size; with them come how many batches they are (the next
    batch draws from the next index's seed) and the batch size the sampling started with (`resumed_batch_size`).

    Why the batch size is not part of what must match: by default it follows the memory free when the sampling
    starts, which moves between attempts (another GPU, another job beside it); the kept rows are the teacher's
    samples under the key whatever size drew them, and refusing them would sample hours of rows again."""

    path: Path
    identity: str
    rows: torch.Tensor | None = None
    batches: int = 0
    batch_size: int | None = None

    @classmethod
    def open(
        cls, folder: Path | None, name: str, key: dict[str, Any] | None, rank: int, world: int
    ) -> FinishedBatches | None:
        """The finished batches of this process under `folder` (None without a cache), with those a stopped
        sampling left read back."""
        if folder is None or key is None:
            return None
        identity = {"key": key, "rank": rank, "world_size": world}
        kept = cls(folder / f"{name}.partial-rank{rank}.safetensors", json.dumps(identity, sort_keys=True))
        if kept.path.is_file():
            ids, metadata = _read_rows(kept.path)
            saved = json.loads(metadata.get("identity", "{}"))
            size = saved.pop("batch_size", None)  # where files written before it moved out of the identity keep it
            if saved == _as_read_back(identity) and ids is not None and len(ids):
                kept.rows = ids
                kept.batch_size = int(metadata.get("batch_size", size))
                kept.batches = int(metadata.get("batches", -(-len(ids) // kept.batch_size)))
                logger.info("teacher text %s: %d rows of a stopped sampling read back", kept.path, len(ids))
            else:
                logger.info("teacher text %s: another sampling's finished batches, starting from the first", kept.path)
        return kept

    def resumed_batch_size(self, default: int) -> int:
        """The batch size to go on with where the caller gave none: the one the sampling started with while it is at
        most `default` (the free memory's now), so that the rows are those of a sampling never stopped, else
        `default` (a larger batch might not fit now; the rows past the kept ones are then other draws of the same
        distribution)."""
        if self.rows is None or self.batch_size is None:
            return default
        return min(self.batch_size, default)

    def save(self, ids: torch.Tensor, batches: int, batch_size: int) -> None:
        """This process's rows so far, `batches` batches drawn, atomically (a stop while writing keeps the last
        ones). The batch size kept is the one the sampling started with (`batch_size` where this attempt started
        it), so that an attempt with little memory does not hold every later one to its smaller batches."""
        from safetensors.torch import save_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        started = self.batch_size if self.rows is not None and self.batch_size is not None else batch_size
        metadata = {"identity": self.identity, "batches": str(batches), "batch_size": str(started)}
        write_atomically(self.path, lambda path: save_file({"input_ids": ids.contiguous()}, str(path), metadata))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
