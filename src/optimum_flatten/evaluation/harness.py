"""lm-eval wrapper: the FlattenGPT paper's zero-shot tasks, and a local-text perplexity task that runs offline.

lm-eval is optional (``pip install optimum-flatten[eval]``) and imported only when these functions run. The zero-shot
tasks need their datasets from the Hub (network); `local_text_task` builds an lm-eval task over local documents
(rolling log-likelihood: word perplexity, byte perplexity, bits per byte) that needs nothing but the files.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

#: The zero-shot tasks reported in the FlattenGPT paper.
PAPER_TASKS = ("winogrande", "hellaswag", "piqa", "arc_easy", "arc_challenge")


def _require_lm_eval():
    try:
        import lm_eval
    except ImportError as error:
        raise ImportError("the lm-eval wrapper needs lm-eval: pip install optimum-flatten[eval]") from error
    return lm_eval


def check_tasks(tasks: Sequence[str], limit: int | float | None = None) -> None:
    """Refuses, before any model loads, what `run_lm_eval` would refuse only after the model's other measurements:
    lm-eval missing, a limit that leaves no document, and a task lm-eval does not know (the offline
    ``local_text_perplexity`` is built from the evaluation text, so it is always known)."""
    import difflib

    _require_lm_eval()
    if limit is not None and limit <= 0:
        raise ValueError(f"the lm-eval limit must leave at least one document per task, got {limit}.")
    wanted = [task for task in tasks if task != "local_text_perplexity"]
    if not wanted:
        return
    from lm_eval.tasks import TaskManager

    known = set(TaskManager().all_tasks)
    for task in wanted:
        if task not in known:
            close = difflib.get_close_matches(task, [*known, "local_text_perplexity"], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"lm-eval has no task {task!r}{hint}")


def local_text_task(texts: Sequence[str], directory: str | Path, name: str = "local_text_perplexity") -> Path:
    """Writes an lm-eval task (YAML + JSONL documents) over `texts` into `directory` and returns the directory.

    Pass it to `run_lm_eval(..., include_path=directory, tasks=[name])`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    documents = directory / f"{name}.jsonl"
    documents.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (directory / f"{name}.yaml").write_text(
        "\n".join(
            [
                f"task: {name}",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {json.dumps(str(documents))}",
                "test_split: test",
                "output_type: loglikelihood_rolling",
                'doc_to_text: ""',
                'doc_to_target: "{{text}}"',
                "should_decontaminate: false",
                "metric_list:",
                "  - metric: word_perplexity",
                "  - metric: byte_perplexity",
                "  - metric: bits_per_byte",
                "metadata:",
                "  version: 1.0",
                "",
            ]
        ),
        encoding="utf-8",
    )
    return directory


def run_lm_eval(
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[str] = PAPER_TASKS,
    batch_size: int = 8,
    num_fewshot: int | None = 0,
    limit: int | float | None = None,
    include_path: str | Path | None = None,
    max_length: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Runs lm-eval's `simple_evaluate` on an in-memory model and returns ``{task: {metric: value}}``.

    Args:
        model, tokenizer: The (compressed or dense) model, wrapped with lm-eval's HFLM.
        tasks: lm-eval task names (default: the paper's zero-shot tasks; they download their datasets).
        batch_size, num_fewshot, limit: As in lm-eval.
        include_path: A folder of extra task YAMLs (see `local_text_task`).
        max_length: Context length of the rolling windows (default: the model's).
    """
    lm_eval = _require_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
    results = lm_eval.simple_evaluate(
        model=wrapped,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
    )
    return {task: dict(metrics) for task, metrics in results["results"].items()}


def local_text_perplexity(
    model: nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 8, max_length: int | None = None
) -> dict[str, Any]:
    """Word/byte perplexity of `texts` through lm-eval, fully offline."""
    with tempfile.TemporaryDirectory() as directory:
        local_text_task(texts, directory)
        return run_lm_eval(
            model,
            tokenizer,
            tasks=["local_text_perplexity"],
            batch_size=batch_size,
            num_fewshot=None,
            include_path=directory,
            max_length=max_length,
        )["local_text_perplexity"]
