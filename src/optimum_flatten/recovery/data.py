"""Recovery data: Alpaca-format instructions (the FlattenGPT paper's recipe), chat conversations (TRL's
conversational ``messages`` records, rendered with the tokenizer's chat template) or plain text, as token rows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ..calibration.data import (
    load_saved_dataset,
    load_texts,
    read_csv,
    read_json,
    read_jsonl,
    single_split,
)
from ..calibration.tokens import token_stream, tokenize_texts
from ..utils.errors import CalibrationDataError

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)
ALPACA_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n{output}"
)


def format_alpaca(record: dict[str, Any]) -> str:
    """The standard Alpaca prompt with its response (instruction, optional input, output)."""
    template = ALPACA_WITH_INPUT if str(record.get("input") or "").strip() else ALPACA_WITHOUT_INPUT
    return template.format(
        instruction=record["instruction"], input=record.get("input") or "", output=record.get("output", "")
    )


def _records(path: Path) -> list[dict[str, Any]] | None:
    if path.suffix.lower() == ".jsonl":
        return read_jsonl(path)
    if path.suffix.lower() == ".csv":
        return read_csv(path)
    if path.suffix.lower() == ".json":
        data = read_json(path)
        if isinstance(data, dict):  # {"data": [...]}, as `load_texts` reads a .json file
            data = data.get("data")
        return data if isinstance(data, list) else None
    return None


def _of_one_kind(records: list[Any] | None, field: str, valid: Any, lacks: str, kind: str, give: str) -> bool:
    """Whether the records are of the kind their first one's `field` says (False when it has none); a later record
    whose `field` is missing or not `valid` is refused by its index, rather than failing on it half-way."""
    if not records or not isinstance(records[0], dict) or field not in records[0]:
        return False
    lacking = next(
        (i for i, r in enumerate(records) if not (isinstance(r, dict) and field in r and valid(r[field]))), None
    )
    if lacking == 0:  # the record that says the kind is itself malformed
        raise CalibrationDataError(
            f"record 0 has a '{field}' field but no {lacks}: give every record one{give}, or none (plain text in a "
            "'text' field)."
        )
    if lacking is not None:
        raise CalibrationDataError(
            f"record {lacking} has no {lacks}, and record 0 is {kind} record: give every record one{give}, or none "
            "(plain text in a 'text' field)."
        )
    return True


def _alpaca(records: list[Any] | None) -> list[str] | None:
    """The records formatted as Alpaca prompts when the first has an ``instruction`` (None otherwise)."""
    given = " (instruction, optional input, output)"
    if not _of_one_kind(records, "instruction", lambda _: True, "'instruction' field", "an Alpaca", given):
        return None
    return [format_alpaca(r) for r in records]


def _conversations(records: list[Any] | None) -> list[list[dict[str, Any]]] | None:
    """The records' ``messages`` when the first holds one (None otherwise): TRL's conversational format, a list of
    ``{"role", "content"}`` turns a record."""

    def turns(value: Any) -> bool:
        # A conversation whose every turn is empty would train on the template's markup alone.
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in value)
            and any(str(t["content"]).strip() for t in value)
        )

    lacks = "'messages' list of {'role', 'content'} turns with some content"
    if not _of_one_kind(records, "messages", turns, lacks, "a chat", ""):
        return None
    return [record["messages"] for record in records]


def render_chat(tokenizer: Any, conversations: list[list[dict[str, Any]]]) -> list[str]:
    """Each conversation as the text its tokenizer's chat template writes (special tokens as text, which
    `tokenize_texts` encodes to their ids without adding another BOS): the model trains on what it reads at
    inference, not on a format of ours. A tokenizer without a template is refused before anything is read."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise CalibrationDataError(
            "the records are chat 'messages', and the tokenizer has no chat template to write them with; give a "
            "tokenizer that has one, or plain text in a 'text' field."
        )
    return [tokenizer.apply_chat_template(turns, tokenize=False) for turns in conversations]


def load_recovery_texts(dataset: Any, text_column: str = "text", tokenizer: Any = None) -> tuple[list[str], str]:
    """Texts to train on and their kind (``"alpaca"``, ``"chat"`` or ``"text"``).

    Records with an ``instruction`` field (a local .json/.jsonl/.csv file, or a `datasets` dataset such as
    ``"yahma/alpaca-cleaned"`` when online) are formatted as Alpaca prompts; records with ``messages`` (TRL's
    conversational format) are written by `tokenizer`'s chat template (`render_chat`); anything `load_texts`
    accepts (plain text files, bundled corpora, lists of strings) is used as plain text. Alpaca and chat records
    are one training row each (`build_training_rows`).
    """
    kind, read = _read_recovery_data(dataset, text_column)
    return (render_chat(tokenizer, read), kind) if kind == "chat" else (read, kind)


def check_recovery_data(dataset: Any, text_column: str = "text") -> str:
    """Reads `dataset` as `load_recovery_texts` will and returns its kind, without a tokenizer: a command refuses a
    missing, malformed or empty file, or a missing column, before it loads a model (chat records are rendered, and
    their template checked, once the tokenizer is there)."""
    return _read_recovery_data(dataset, text_column)[0]


def check_local_recovery_data(dataset: Any, text_column: str = "text") -> None:
    """`check_recovery_data` for a local file or folder (and a misspelt bundled corpus), before a command loads a
    model: a missing, malformed or empty file, or a missing column, was refused only after the load. Bundled corpora
    and `datasets` names are read once, after it."""
    from ..calibration.data import DATA_SUFFIXES, check_bundled_name

    if not isinstance(dataset, (str, Path)):
        return
    check_bundled_name(str(dataset))
    path = Path(dataset).expanduser()
    if path.exists() or path.suffix.lower() in DATA_SUFFIXES:
        check_recovery_data(str(path) if path.exists() else str(dataset), text_column)


def _read_recovery_data(dataset: Any, text_column: str) -> tuple[str, Any]:
    """(kind, what was read): Alpaca prompts, chat conversations (not rendered yet) or plain texts."""
    records = None
    if isinstance(dataset, (str, Path)):  # a folder `datasets`' save_to_disk wrote reads as the dataset it holds
        saved = load_saved_dataset(Path(dataset))
        dataset = dataset if saved is None else saved
    dataset = single_split(dataset)
    if isinstance(dataset, (str, Path)) and Path(dataset).is_file():
        records = _records(Path(dataset))
    elif hasattr(dataset, "column_names") and {"instruction", "messages"} & set(dataset.column_names or ()):
        records = [dict(row) for row in dataset]  # a Dataset's rows, or an IterableDataset's as they stream
    elif isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], dict):
        records = list(dataset)
    alpaca = _alpaca(records)
    if alpaca is not None:
        return "alpaca", alpaca
    conversations = _conversations(records)
    if conversations is not None:
        return "chat", conversations
    return "text", load_texts(dataset, text_column)


def build_training_rows(
    tokenizer: Any, texts: list[str], kind: str, seqlen: int, max_samples: int | None, seed: int
) -> list[dict[str, torch.Tensor]]:
    """Token rows for causal-LM training; labels are -100 on padding so it never contributes to the loss.

    Plain text is concatenated (EOS-separated) and cut into `seqlen` windows; Alpaca examples and chat
    conversations are one row each, truncated to `seqlen` and right-padded.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = int(pad if pad is not None else (eos if eos is not None else 0))
    rows: list[dict[str, torch.Tensor]] = []
    if kind == "text":
        stream = token_stream(tokenizer, texts)  # int64, 8 bytes a token
        for start in range(0, len(stream) - seqlen + 1, seqlen):
            ids = stream[start : start + seqlen].clone()  # its own storage, as each row had from a list
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    else:
        for tokens in tokenize_texts(tokenizer, texts):
            tokens = tokens[: seqlen - 1]
            if eos is not None:
                tokens.append(int(eos))
            ids = torch.full((seqlen,), pad, dtype=torch.long)
            mask = torch.zeros(seqlen, dtype=torch.long)
            ids[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[: len(tokens)] = 1
            labels = ids.masked_fill(mask == 0, -100)
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    if not rows:
        raise CalibrationDataError(f"the recovery data yields no training row of {seqlen} tokens; give more text.")
    if max_samples is not None and len(rows) > max_samples:
        rows = [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), max_samples))]
    return rows
