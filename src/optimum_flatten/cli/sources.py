"""Where a command's MODEL argument points: refused early when it cannot be a model, resolved to a folder; and a Hub
push that cannot happen, refused before the work."""

from __future__ import annotations

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
