"""Where a command's MODEL argument points: refused early when it cannot be a model, resolved to a folder."""

from __future__ import annotations

from ..utils.loading import resolve_model_source


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
