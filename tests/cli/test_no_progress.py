"""`--no-progress` hides the bars of the libraries under the commands too: on the command line lm-eval's and
datasets' (plain tqdm, which reads TQDM_DISABLE when imported), and transformers' and the Hub's (their own switches),
which `main` called in-process restores after."""

from __future__ import annotations

import subprocess
import sys

from optimum_flatten.cli.main import main

_FRESH = """
import os
from optimum_flatten.utils.progress import progress_hidden

with progress_hidden(whole_process=True):
    from tqdm import tqdm                                   # what lm-eval draws with
    from datasets.utils.tqdm import tqdm as datasets_tqdm
    from huggingface_hub.utils import tqdm as hub_tqdm
    from transformers.utils import logging
    hidden = [tqdm(range(2)).disable, datasets_tqdm(range(2)).disable, hub_tqdm(range(2)).disable,
              not logging.is_progress_bar_enabled()]
from huggingface_hub.utils import are_progress_bars_disabled
print(hidden, logging.is_progress_bar_enabled(), are_progress_bars_disabled())
"""


def test_every_library_bar_is_hidden_on_the_command_line_and_the_switches_restored_after():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split("\n")[0] == "[True, True, True, True] True False"


def test_the_command_line_draws_no_bar_with_no_progress(llama_on_disk):
    dense, text = llama_on_disk
    argv = ["evaluate", str(dense), "--dataset", str(text), "--no-speed", "--seqlen", "32", "--max-tokens", "256"]
    shown = subprocess.run(["optimum-flatten", *argv], capture_output=True, text=True, timeout=300)
    hidden = subprocess.run(["optimum-flatten", *argv, "--no-progress"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == hidden.returncode == 0, shown.stderr + hidden.stderr
    assert "it/s]" in shown.stderr and "it/s]" not in hidden.stderr
    # In-process, the switches are restored after the command, and tqdm's own default is left alone.
    import os

    from transformers.utils import logging

    assert main([*argv, "--no-progress", "--no-generation"]) == 0
    assert logging.is_progress_bar_enabled() and "TQDM_DISABLE" not in os.environ
