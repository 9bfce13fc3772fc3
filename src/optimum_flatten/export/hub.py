"""Publishing a compressed checkpoint on the Hugging Face Hub: save locally first, then upload what the save wrote.

Only the checkpoint's own files are uploaded: with ``overwrite`` the local folder also keeps the user's files (notes,
an ``.env``, evaluation results), and those are not ours to publish.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from torch import nn

from ..utils.loading import hub_offline
from .atomic import glob_escape
from .checkpoint import CHECKPOINT_PATTERNS, is_checkpoint_file, method_checkpoint_files, save_compressed

logger = logging.getLogger(__name__)

#: The entries of `CHECKPOINT_PATTERNS` that name a folder (transformers writes one file per extra chat template
#: into it). The Hub client matches patterns against file paths, so a bare folder name matches none of its files.
CHECKPOINT_FOLDERS = ("additional_chat_templates",)
#: The variables that turn huggingface_hub's offline mode on, and the values that do (as `utils.loading.hub_offline`).
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = ("1", "ON", "YES", "TRUE")


class HubUploadError(RuntimeError):
    """The upload failed; the local save it was made from is intact."""


def check_hub_repo(repo_id: str, api: Any = None) -> None:
    """Refuses, before any compression or save, a push that cannot succeed: a repo id the Hub rejects, or
    huggingface_hub's offline mode. Both would otherwise surface only after the work, at the upload.

    Args:
        repo_id: The Hub repo the checkpoint is to be pushed to.
        api: The client the upload will use (`push_to_hub`'s ``api``). Offline mode blocks huggingface_hub's own
            `HfApi` only, so it is checked for that client (the default, None) and not for a stand-in transport.

    Raises:
        ValueError: one line, naming the repo id or the offline setting and what to do instead.
    """
    from huggingface_hub.hf_api import HfApi  # the class, even where a test replaces huggingface_hub.HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if not isinstance(repo_id, str):
            raise HFValidationError("not a string")  # validate_repo_id lets None through: a push needs a repo
        validate_repo_id(repo_id)
    except HFValidationError:
        # Its message spans the rules and the repo_type argument, which a push does not take: say it in one line.
        raise ValueError(
            f"{repo_id!r} is not a valid Hub repo id: expected 'name' or 'namespace/name' (letters, digits, '-', '_' "
            "and '.', at most 96 characters each, no '--' or '..'); choose another repo id."
        ) from None
    if (api is None or isinstance(api, HfApi)) and hub_offline():
        name = next(
            (v for v in _OFFLINE_VARIABLES if os.environ.get(v, "").strip().upper() in _TRUE), _OFFLINE_VARIABLES[0]
        )
        raise ValueError(
            f"cannot push to the Hub repo {repo_id!r}: huggingface_hub's offline mode is on ({name} is set), so the "
            f"upload would fail after the work; unset {name}, or save without pushing (--output, or "
            "FlattenQuantizer.save) and upload the folder later with `hf upload`."
        )


def push_to_hub(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    report: dict[str, Any] | None = None,
    local_dir: str | Path | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    overwrite: bool = False,
    api: Any = None,
) -> str:
    """Saves the plain checkpoint (weights, tokenizer, flatten_report.json, heatmap, model card) and uploads it.

    The folder is written (atomically) before anything touches the network, so an offline or unauthenticated
    upload loses nothing: the error names the folder and how to upload it later. Only the files the save wrote are
    uploaded (`upload_patterns`); other files that ``overwrite`` kept in the folder stay local.

    Args:
        model: The compressed model.
        repo_id: ``"user/name"`` on the Hub; created if missing.
        tokenizer: Saved beside the weights when given.
        report: `FlattenQuantizer.report` (plus e.g. an ``"evaluation"`` entry), rendered into the model card.
        local_dir: Where to save first (default: ``./<name>`` from the repo id).
        private, token: Passed to the Hub API.
        commit_message: Defaults to a summary of the plan.
        overwrite: Replace the checkpoint files of an existing checkpoint in `local_dir` (other files are kept;
            see `checkpoint.check_output_dir` for the folders that are refused).
        api: A `huggingface_hub.HfApi`-like object (tests pass a stand-in for the transport).

    Returns:
        The URL of the uploaded commit (or of the repo).

    Raises:
        ValueError: before anything is written, for an invalid repo id or in offline mode (`check_hub_repo`).
        HubUploadError: when creating the repo or uploading fails.
    """
    check_hub_repo(repo_id, api)
    report = dict(report or {})
    folder = save_compressed(
        model, local_dir or Path(repo_id.split("/")[-1]), tokenizer=tokenizer, report=report, overwrite=overwrite
    )
    return upload_checkpoint(folder, repo_id, report, private, token, commit_message, api)


def upload_checkpoint(
    folder: str | Path,
    repo_id: str,
    report: dict[str, Any] | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    api: Any = None,
) -> str:
    """Uploads a checkpoint `save_compressed` wrote (`recover` saves its healed model first, then calls this):
    its files only (`upload_patterns`), clearing the stale ones an earlier upload left (`_stale_patterns`).

    Returns:
        The URL of the uploaded commit (or of the repo).

    Raises:
        HubUploadError: when creating the repo or uploading fails, naming the saved folder and the retry command.
    """
    folder = Path(folder)
    report = report or {}
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    summary = f"{report.get('method', 'compressed')} {report.get('plan_summary', '')}".strip()
    message = commit_message or f"optimum-flatten: {summary}"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=message,
            allow_patterns=upload_patterns(folder),
            delete_patterns=_stale_patterns(),
        )
    except Exception as error:  # network, auth and HTTP errors come in many types
        # One message for the CLI and the API: the CLI has no token option (huggingface_hub reads the login or
        # HF_TOKEN), and only the API takes token=.
        raise HubUploadError(
            f"could not upload to the Hub repo {repo_id!r} ({type(error).__name__}: {error}). The model "
            f"is saved at {folder}; check the network and your login (`hf auth login`, or set HF_TOKEN; from "
            f"Python, push_to_hub(..., token=...)), then upload the checkpoint with `hf upload {repo_id} "
            f"{shlex.quote(str(folder))} {_include_options(folder)} {_delete_options()}"
            # `hf upload` creates a missing repo public unless told: the retry keeps what was asked.
            f"{' --private' if private else ''} --commit-message {shlex.quote(message)}`."
        ) from error
    url = str(getattr(info, "commit_url", None) or getattr(info, "repo_url", None) or info)
    logger.info("uploaded %s to %s", folder, url)
    return url


def upload_patterns(folder: Path) -> list[str]:
    """``allow_patterns`` for `upload_folder` that match the checkpoint in `folder` and nothing else: each of its
    names that is part of a checkpoint (`is_checkpoint_file`: a save removes those it did not write, so these are what
    it wrote), a folder (``additional_chat_templates``) with everything under it. Names are escaped, since the Hub
    client reads the patterns as globs; without them it would upload every file in the folder."""
    names = sorted(p.name for p in Path(folder).iterdir() if is_checkpoint_file(p.name))
    patterns = [glob_escape(name) + ("/*" if (Path(folder) / name).is_dir() else "") for name in names]
    return patterns + [glob_escape(name) for name in remote_code_files(folder, names)]


def remote_code_files(folder: Path, names: list[str]) -> list[str]:
    """The Python files in `folder` that the checkpoint's remote code loads: each module an ``auto_map`` in its JSON
    files (`names`) points to (a tokenizer shipped as ``tokenization_*.py``, a config or model class), with the modules
    those import relatively, as transformers resolves them. `save_pretrained` copies these files, but their names
    are the model's own, so no pattern of `CHECKPOINT_PATTERNS` can list them; without them the published repo's
    ``from_pretrained(..., trust_remote_code=True)`` fails. A reference into another repo (``repo--module.Class``)
    loads from there and is not ours to upload."""
    from transformers.dynamic_module_utils import get_relative_import_files

    modules: set[Path] = set()
    for name in (n for n in names if n.endswith(".json")):
        try:
            auto_map = json.loads((Path(folder) / name).read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # not a JSON object: it names no code
        references = (r for value in auto_map.values() for r in (value if isinstance(value, list) else [value]))
        for reference in references:
            if isinstance(reference, str) and "--" not in reference and "." in reference:
                module = Path(folder) / (reference.rsplit(".", 1)[0].replace(".", "/") + ".py")
                if module.is_file():
                    modules.add(module)
                    modules.update(Path(f) for f in get_relative_import_files(module))
    return sorted(str(m.relative_to(folder)) for m in modules if m.is_file() and m.parent == Path(folder))


def _include_options(folder: Path) -> str:
    """``--include`` options of ``hf upload`` for the checkpoint in `folder` (`upload_patterns`), so that a retry by
    hand publishes the checkpoint and not the other files the folder keeps."""
    return " ".join(f"--include {shlex.quote(pattern)}" for pattern in upload_patterns(folder))


def _stale_patterns() -> list[str]:
    """The checkpoint files an upload removes from the repo before adding its own: a repo holding an earlier upload
    (3 shards and their index, say) would otherwise keep the files this checkpoint does not have, and load as a mix
    of two models. The Hub client matches each pattern against a file's path, so a folder (`CHECKPOINT_FOLDERS`) is
    given as ``folder/*``, which matches the files under it; the bare name would match none."""
    patterns = CHECKPOINT_PATTERNS + method_checkpoint_files()
    return [glob_escape(p) + "/*" if p in CHECKPOINT_FOLDERS else p for p in patterns]


def _delete_options() -> str:
    """``--delete`` options of ``hf upload`` for `_stale_patterns`: a retry by hand clears them as the upload does."""
    return " ".join(f"--delete {shlex.quote(pattern)}" for pattern in _stale_patterns())
