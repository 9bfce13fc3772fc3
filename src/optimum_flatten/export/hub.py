"""Publishing a compressed checkpoint on the Hugging Face Hub: save locally first, then upload what the save wrote.

Only the checkpoint's own files are uploaded: with ``overwrite`` the local folder also keeps the user's files (notes,
an ``.env``, evaluation results), and those are not ours to publish.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from .atomic import glob_escape
from .checkpoint import CHECKPOINT_PATTERNS, is_checkpoint_file, method_checkpoint_files, save_compressed

logger = logging.getLogger(__name__)


class HubUploadError(RuntimeError):
    """The upload failed; the local save it was made from is intact."""


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
        HubUploadError: when creating the repo or uploading fails.
    """
    report = dict(report or {})
    folder = save_compressed(
        model, local_dir or Path(repo_id.split("/")[-1]), tokenizer=tokenizer, report=report, overwrite=overwrite
    )
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
        raise HubUploadError(
            f"could not upload to the Hub repo {repo_id!r} ({type(error).__name__}: {error}). The compressed model "
            f"is saved at {folder}; check the network and your login (`hf auth login`, or pass token=), then "
            f"upload the checkpoint with `hf upload {repo_id} {folder} {_include_options(folder)} "
            f"{_delete_options()}`."
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
    return [glob_escape(name) + ("/*" if (Path(folder) / name).is_dir() else "") for name in names]


def _include_options(folder: Path) -> str:
    """``--include`` options of ``hf upload`` for the checkpoint in `folder` (`upload_patterns`), so that a retry by
    hand publishes the checkpoint and not the other files the folder keeps."""
    import shlex

    return " ".join(f"--include {shlex.quote(pattern)}" for pattern in upload_patterns(folder))


def _stale_patterns() -> list[str]:
    """The checkpoint files an upload removes from the repo before adding its own: a repo holding an earlier upload
    (3 shards and their index, say) would otherwise keep the files this checkpoint does not have, and load as a mix
    of two models."""
    return list(CHECKPOINT_PATTERNS + method_checkpoint_files())


def _delete_options() -> str:
    """``--delete`` options of ``hf upload`` for `_stale_patterns`: a retry by hand clears them as the upload does."""
    import shlex

    return " ".join(f"--delete {shlex.quote(pattern)}" for pattern in _stale_patterns())
