"""Hiding every progress bar a command draws, for `--no-progress`.

Our own bars follow the `progress` flags; the libraries under us draw theirs with tqdm: transformers and the Hub
through switches of their own, datasets and lm-eval through tqdm directly (lm-eval has no switch). tqdm reads
``TQDM_DISABLE`` once, when it is imported, and keeps it for the life of the process: the command line (which imports
no tqdm before its command runs, and ends with it) sets it; `main` called in-process (a notebook, the tests) only
flips the libraries' switches, which it can restore.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def progress_hidden(whole_process: bool) -> Iterator[None]:
    """Hides the bars while the block runs and restores the switches after; `whole_process` (the command line only)
    hides plain tqdm's too, for good."""
    if whole_process:
        os.environ["TQDM_DISABLE"] = "1"  # before the imports below, which import tqdm
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as transformers_logging

    transformers_shown = transformers_logging.is_progress_bar_enabled()
    hub_hidden = hub_utils.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_shown:
            transformers_logging.enable_progress_bar()
        if not hub_hidden:
            hub_utils.enable_progress_bars()
