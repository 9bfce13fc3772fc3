"""Per-layer state of a long compression, so that a job killed mid-way resumes where it stopped.

A 70B compression runs for hours and clusters run jobs in time-limited windows; without this a job killed in its
last group starts again from the selection. With ``FlattenConfig(resume_dir=...)`` the pipeline keeps here:

- ``manifest.json``: what identifies the job (`job_identity`: the method and its options, the depth target and
  stack, a fingerprint of the dense weights and their dtypes, and a hash of the calibration batches) and, once the
  selection is done, the plan with the report entries the selection wrote (the similarity matrix the card shows).
- ``group-<first>-<last>.safetensors``: one per finished merged group, the compressed block's ``state_dict`` with,
  in the file's metadata, what rebuilds the module before the weights are loaded (kept KV groups and MLP channels)
  and the group's report entry.
- ``own_text/``: the model's own calibration rows (`CalibrationConfig.own_text`, `recovery.own_calibration`),
  sampled by the first attempt, so that a resumed one calibrates on the same rows without sampling them again.

Every file is written under a temporary name in the folder and renamed over its final name (`os.replace`, atomic
on one file system), so a kill leaves the old or the new file, never half of one: a group file exists only once its
group is complete, and the plan only once the selection is. Nothing is ever deleted: a folder of another job is
refused, and the state of a finished job stays (a rerun reproduces the checkpoint from it) until the user removes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..plan import LayerPlan
from ..utils.differences import describe_differences
from ..utils.files import TEMPORARY_PREFIX, write_atomically, write_bytes_atomically

#: The manifest's file name in `resume_dir`.
MANIFEST = "manifest.json"
#: The folder of the model's own calibration rows in `resume_dir` (kept before the manifest is written).
OWN_TEXT = "own_text"
#: The identity's entry of the values behind its hashes (`job_identity`): read to word a refusal, never compared.
NAMED = "named"
#: Version of the folder's layout; a folder written by another version is refused (its files may mean otherwise).
FORMAT = 1


def calibration_fingerprint(batches: Sequence[Any]) -> str:
    """A hex digest of every calibration batch's tensors, in order: the states a resumed run recomputes are only
    the interrupted run's when the batches are the same tokens (the calibration data is small, so all of it is
    hashed, unlike the weights)."""
    digest = hashlib.sha256()
    for batch in batches:
        for name in ("input_ids", "attention_mask", "pixel_values"):
            tensor = getattr(batch, name, None)
            if tensor is None:
                continue
            tensor = tensor.detach().to("cpu").contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def options_fingerprint(options: Mapping[str, Any]) -> str:
    """A hex digest of a JSON-able mapping (the method's options and the corrections), key order aside."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:32]


def job_identity(
    *,
    method: str,
    options: Mapping[str, Any],
    stack: str,
    num_layers: int,
    num_to_remove: int,
    weights: str,
    dtypes: Sequence[str],
    calibration: str | None,
    named: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """What a resumed run must share with the interrupted one for its saved plan and blocks to be this job's.

    `weights` is `utils.fingerprint.weights_fingerprint` of the dense model (a sample of every tensor: a full
    checksum of 70B weights would read 140 GB on every start); `dtypes` are the parameters' dtypes, which that
    fingerprint rounds away and which the saved blocks' values depend on. `named`: the values behind the hashed
    ``options`` and ``calibration`` (the calibration's settings for its batches), kept beside them and never compared,
    so that a refusal can name the option that differs rather than the hash.
    """
    extra = {NAMED: json.loads(json.dumps(named, sort_keys=True, default=str))} if named is not None else {}
    return {
        **extra,
        "format": FORMAT,
        "method": method,
        "options": options_fingerprint(options),
        "stack": stack,
        "num_layers": num_layers,
        "num_to_remove": num_to_remove,
        "weights": weights,
        "dtypes": sorted(set(dtypes)),
        "calibration": calibration,
    }


def _named_differences(saved: Any, now: Any, differ: Sequence[str]) -> str:
    """``": seed: 0 then, 1 now, ..."`` for the hashed entries among `differ` whose named values both identities
    keep (`job_identity`'s `named`), else nothing (a folder written before they were kept)."""
    if not isinstance(saved, Mapping) or not isinstance(now, Mapping):
        return ""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    for part in (part for part in differ if part in saved and part in now):
        before.update(_flat(saved[part]))
        after.update(_flat(now[part]))
    detail = describe_differences(before, after)
    return f": {detail}" if detail else ""


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`values` with nested mappings' keys joined by dots (``method_args.ridge_ratio``)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass(frozen=True)
class SavedGroup:
    """One finished merged group as saved: its block's weights and what rebuilds the module they load into."""

    indices: tuple[int, ...]
    state: dict[str, torch.Tensor]
    kept_kv_groups: list[int]
    kept_channels: list[int]
    report: dict[str, Any]


class ResumeState:
    """The resume folder of one job: its saved plan and finished groups, and the atomic writes that add to them.

    Opened (and checked against the job) by `open`, before calibration and before any weight changes.
    """

    def __init__(self, directory: Path, identity: dict[str, Any], manifest: dict[str, Any] | None) -> None:
        self.directory = directory
        self.identity = identity
        self._manifest = manifest
        #: What the earlier attempts spent on the state kept here (`spent`): seconds and the context's work.
        self.before: dict[str, float] = _spent_before(directory, manifest)
        self._context: Any = None
        self._began = time.perf_counter()

    def begin(self, context: Any) -> None:
        """Starts this attempt's count: its seconds from now, and `context`'s work (`MethodContext.work`)."""
        self._context, self._began = context, time.perf_counter()

    def spent(self) -> dict[str, float]:
        """Seconds and work of every attempt so far: the earlier attempts' (up to their last write here) and this
        one's, written with each plan and group so that the report of a resumed run counts the work it kept."""
        work = int(getattr(self._context, "work", 0) or 0)
        return {
            "seconds": round(self.before["seconds"] + time.perf_counter() - self._began, 3),
            "work": int(self.before["work"]) + work,
        }

    @classmethod
    def open(cls, directory: str | os.PathLike[str], identity: dict[str, Any]) -> ResumeState:
        """The state kept in `directory` for the job `identity` (an empty or absent folder: a new job).

        Writes nothing: the manifest is first written with the plan (`save_plan`).

        Raises:
            ValueError: one line, when the folder holds another job's state or files that are no job's state.
        """
        return cls(Path(directory), identity, cls._manifest_of(Path(directory), identity))

    @classmethod
    def check(cls, directory: str | os.PathLike[str], identity: dict[str, Any]) -> None:
        """`open`'s refusals, reading only: run before anything is written into the folder (the model's own
        calibration rows, which are kept there). A key of `identity` that is None is not known yet (the calibration
        before its rows exist) and is not compared; `open` compares it later.

        Raises:
            ValueError: as `open`.
        """
        cls._manifest_of(Path(directory), identity)

    @staticmethod
    def _manifest_of(path: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
        """The manifest of the job kept in `path` (None for a new job), once the folder is checked against
        `identity` (its None values left out)."""
        if path.exists() and not path.is_dir():
            raise ValueError(f"resume_dir {str(path)!r} is a file; give a folder (it is created when absent).")
        manifest_path = path / MANIFEST
        if not manifest_path.exists():
            listed = path.iterdir() if path.is_dir() else ()
            # A temporary file is a killed write's leftover, not another job's state.
            others = sorted(p.name for p in listed if not p.name.startswith(TEMPORARY_PREFIX) and p.name != OWN_TEXT)
            if others:
                raise ValueError(
                    f"resume_dir {str(path)!r} holds {others[:3]} but no {MANIFEST}: it is no compression's state; "
                    "give an empty or new folder."
                )
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            saved = manifest["identity"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"resume_dir {str(path)!r}: unreadable {MANIFEST} ({error}); give a new folder.") from None
        unknown = {key for key, value in identity.items() if value is None} | {NAMED}
        compared = sorted((set(identity) | set(saved)) - unknown)
        differ = [key for key in compared if identity.get(key) != saved.get(key)]
        if differ:
            verb = "differs" if len(differ) == 1 else "differ"
            detail = _named_differences(saved.get(NAMED), identity.get(NAMED), differ)
            raise ValueError(
                f"resume_dir {str(path)!r} holds the state of another job (its {', '.join(differ)} {verb} from this "
                f"run's{detail}); rerun with that job's model, options and calibration, or give a new folder (nothing "
                "was changed or deleted)."
            )
        _check_groups(path)
        return manifest

    # ------------------------------------------------------------------ plan

    @property
    def plan(self) -> LayerPlan | None:
        """The saved plan, or None when the interrupted run had not finished its selection."""
        if self._manifest is None or self._manifest.get("plan") is None:
            return None
        return LayerPlan.from_dict(self._manifest["plan"])

    @property
    def plan_report(self) -> dict[str, Any]:
        """The report entries the selection wrote (the resumed run skips the selection, the report keeps them)."""
        return dict((self._manifest or {}).get("plan_report") or {})

    def save_plan(self, plan: LayerPlan, report: Mapping[str, Any]) -> None:
        """Writes the manifest with `plan` and the selection's report entries `report` (JSON-able)."""
        manifest = {
            "identity": self.identity,
            "plan": plan.to_dict(),
            "plan_report": dict(report),
            "spent": self.spent(),
        }
        self._write(MANIFEST, json.dumps(manifest, indent=1).encode())
        self._manifest = manifest

    # ---------------------------------------------------------------- groups

    def group_path(self, indices: Sequence[int]) -> Path:
        return self.directory / _group_name(indices)

    def has_group(self, indices: Sequence[int]) -> bool:
        return self.group_path(indices).exists()

    def load_group(self, indices: Sequence[int]) -> SavedGroup | None:
        """The saved group `indices`, or None when it was not finished."""
        path = self.group_path(indices)
        if not path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if tuple(json.loads(metadata.get("indices", "[]"))) != tuple(indices):
            raise ValueError(f"resume_dir file {path.name} does not hold group {list(indices)}; give a new folder.")
        return SavedGroup(
            indices=tuple(indices),
            state=load_file(str(path)),
            kept_kv_groups=json.loads(metadata["kept_kv_groups"]),
            kept_channels=json.loads(metadata["kept_channels"]),
            report=json.loads(metadata["report"]),
        )

    def save_group(
        self,
        indices: Sequence[int],
        state: Mapping[str, torch.Tensor],
        kept_kv_groups: Sequence[int],
        kept_channels: Sequence[int],
        report: Mapping[str, Any],
    ) -> None:
        """Writes one finished group: `state` (the block's ``state_dict``, copied to the CPU) and, as metadata, the
        kept KV groups and channels the module is rebuilt with and the group's report entry."""
        tensors = {name: value.detach().to("cpu").contiguous() for name, value in state.items()}
        metadata = {
            "format": str(FORMAT),
            "indices": json.dumps([int(i) for i in indices]),
            "kept_kv_groups": json.dumps([int(i) for i in kept_kv_groups]),
            "kept_channels": json.dumps([int(i) for i in kept_channels]),
            "report": json.dumps(dict(report)),
            "spent": json.dumps(self.spent()),
        }
        write_atomically(
            self.directory / _group_name(indices),
            lambda temporary: save_file(tensors, str(temporary), metadata=metadata),
        )

    def _write(self, name: str, data: bytes) -> None:
        write_bytes_atomically(self.directory / name, data)


#: What every finished group's file says of itself (`ResumeState.save_group`), read back by `load_group`.
GROUP_METADATA = ("indices", "kept_kv_groups", "kept_channels", "report")


def _check_groups(directory: Path) -> None:
    """Refuses a resume folder with a finished group's file that cannot be read back (truncated, overwritten, its
    metadata incomplete), in one line, when the folder is opened: found only when its group's turn came, it would
    fail the run with the groups before it already in the model."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(directory.glob("group-*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                for name in handle.keys():
                    handle.get_slice(name)
            missing = [key for key in GROUP_METADATA if key not in metadata]
            if missing:
                raise ValueError(f"no {', '.join(missing)} in its metadata")
            json.loads(metadata["indices"])
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(
                f"resume_dir {str(directory)!r}: the finished group {path.name} cannot be read back ({error}); give "
                "a new folder (nothing was changed)."
            ) from None


def _spent_before(directory: Path, manifest: Mapping[str, Any] | None) -> dict[str, float]:
    """The latest record of what the earlier attempts spent (`ResumeState.spent`): the manifest's or a finished
    group's, whichever counts the most seconds; none (a new job, or state written before this was kept): zero."""
    from safetensors import safe_open

    records = [(manifest or {}).get("spent")]
    for path in sorted(directory.glob("group-*.safetensors")) if directory.is_dir() else ():
        with safe_open(str(path), framework="pt") as handle:
            records.append(json.loads((handle.metadata() or {}).get("spent", "null")))
    kept = [r for r in records if isinstance(r, dict)]
    return max(kept, key=lambda r: r["seconds"]) if kept else {"seconds": 0.0, "work": 0}


def _group_name(indices: Sequence[int]) -> str:
    return f"group-{indices[0]:03d}-{indices[-1]:03d}.safetensors"
