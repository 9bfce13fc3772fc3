"""Side-by-side evaluation of checkpoints (dense vs compressed): perplexity, fidelity, speed, and a figure."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..calibration.data import load_texts
from ..utils.files import write_atomically
from .fidelity import fidelity
from .perplexity import perplexity, tokenize_corpus
from .speed import SpeedComparison, compare_decode, compare_prefill, decode_tokens_per_second, prefill_tokens_per_second


class Checkpoints:
    """The models, tokenizers and token streams that one evaluation reads, each loaded or tokenised once.

    `optimum-flatten evaluate` scores a checkpoint's perplexity and then compares it with its baseline three more
    ways (speed, KL and top-1, greedy agreement); loaded by each measurement, every checkpoint was read from disk up
    to four times (minutes each at 7B) and the text tokenised as often. Those comparisons need both models in memory
    at once anyway, so holding them across the measurements (`keep_models`) costs no peak memory the run did not
    already need; without it each `model` call loads afresh and the caller's reference is the only one.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        keep_models: bool = True,
    ) -> None:
        self.dtype, self.device, self.trust_remote_code = dtype, device, trust_remote_code
        self.keep_models = keep_models
        self._models: dict[str, Any] = {}
        self._tokenizers: dict[str, Any] = {}
        self._streams: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}

    def model(self, path: str | Path) -> Any:
        """The causal LM at `path` in this evaluation's dtype, on its device, in eval mode."""
        key = str(path)
        if key in self._models:
            return self._models[key]
        model = _load_model(path, self.dtype, self.device, self.trust_remote_code)
        if self.keep_models:
            self._models[key] = model
        return model

    def tokenizer(self, path: str | Path) -> Any:
        """The tokenizer saved beside `path`."""
        key = str(path)
        if key not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[key] = AutoTokenizer.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        return self._tokenizers[key]

    def tokens(self, path: str | Path, texts: Sequence[str]) -> torch.Tensor:
        """`texts` as one stream in the tokens of `path`'s tokenizer (`tokenize_corpus`)."""
        key = (str(path), tuple(texts))
        if key not in self._streams:
            self._streams[key] = tokenize_corpus(self.tokenizer(path), list(texts))
        return self._streams[key]


def evaluate_checkpoint(
    path: str | Path,
    dataset: Any,
    seqlen: int = 512,
    stride: int | None = None,
    max_tokens: int | None = 16384,
    dtype: torch.dtype = torch.float32,
    speed: bool = True,
    lm_eval_tasks: Sequence[str] = (),
    lm_eval_limit: int | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    speed_repeats: int = 5,
    checkpoints: Checkpoints | None = None,
) -> dict[str, Any]:
    """Perplexity (with its protocol), prefill/decode throughput and optional lm-eval tasks of one checkpoint.

    ``"local_text_perplexity"`` among `lm_eval_tasks` is the offline lm-eval task over the same `dataset` texts
    (capped at 64 documents); other names are lm-eval's own tasks (they download their data). Speeds are medians of
    `speed_repeats` synchronised runs on `device`, with their spread and environment; to compare two checkpoints'
    speed use `speed_against_baseline`, which interleaves them. `checkpoints` shares loaded models, tokenizers and
    token streams between measurements (and then sets dtype, device and remote code); by default this call loads
    its own.
    """
    checkpoints = checkpoints or Checkpoints(dtype, device, trust_remote_code, keep_models=False)
    model, tokenizer = checkpoints.model(path), checkpoints.tokenizer(path)
    texts = load_texts(dataset)
    stream = checkpoints.tokens(path, texts)
    result = perplexity(model, stream, seqlen=seqlen, stride=stride, max_tokens=max_tokens)
    entry: dict[str, Any] = {
        "path": str(path),
        # An image-text model (Gemma 3) keeps its decoder's depth in text_config; a text model is its own.
        "layers": model.config.get_text_config().num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "perplexity": result.perplexity,
        "protocol": result.protocol(),
    }
    if speed:
        entry["prefill"] = prefill_tokens_per_second(model, seqlen=seqlen, repeats=speed_repeats)
        entry["decode"] = decode_tokens_per_second(model, repeats=speed_repeats)
    if lm_eval_tasks:
        from .harness import local_text_task, run_lm_eval

        with tempfile.TemporaryDirectory() as directory:
            local_text_task(texts[:64], directory)
            entry["lm_eval"] = run_lm_eval(
                model,
                tokenizer,
                tasks=list(lm_eval_tasks),
                include_path=directory,
                limit=lm_eval_limit,
                max_length=seqlen,
            )
    report = Path(path) / "flatten_report.json"
    if report.exists():
        entry["flatten_report"] = json.loads(report.read_text(encoding="utf-8"))
    return entry


def fidelity_to_baseline(
    baseline: str | Path,
    path: str | Path,
    dataset: Any,
    seqlen: int = 512,
    stride: int | None = None,
    max_tokens: int | None = 16384,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    checkpoints: Checkpoints | None = None,
) -> dict[str, Any]:
    """KL(baseline ‖ model) per token and top-1 agreement on the windows `evaluate_checkpoint` scores.

    Both checkpoints are loaded at once (the comparison needs both distributions for the same positions), so this
    needs the memory of the two models; the text is tokenised with the baseline's tokenizer, as for its perplexity.
    `checkpoints`: as for `evaluate_checkpoint`.
    """
    checkpoints = checkpoints or Checkpoints(dtype, device, trust_remote_code)
    dense, model, stream = _pair_on_text(checkpoints, baseline, path, dataset)
    return fidelity(dense, model, stream, seqlen=seqlen, stride=stride, max_tokens=max_tokens).to_dict()


def generation_against_baseline(
    baseline: str | Path,
    path: str | Path,
    dataset: Any,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    prompts: int = 16,
    prompt_length: int = 64,
    new_tokens: int = 32,
    checkpoints: Checkpoints | None = None,
) -> dict[str, Any]:
    """`generation_agreement` of the checkpoint at `path` with `baseline`, on prompts cut from `dataset` (tokenised
    with the baseline's tokenizer); the protocol is in the result. `checkpoints`: as for `evaluate_checkpoint`."""
    from .generation import generation_agreement

    checkpoints = checkpoints or Checkpoints(dtype, device, trust_remote_code)
    dense, model, stream = _pair_on_text(checkpoints, baseline, path, dataset)
    result = generation_agreement(dense, model, stream, prompts, prompt_length, new_tokens)
    return {**result.to_dict(), "protocol": result.protocol()}


def speed_against_baseline(
    baseline: str | Path,
    path: str | Path,
    seqlen: int = 512,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    rounds: int = 5,
    trust_remote_code: bool = False,
    checkpoints: Checkpoints | None = None,
) -> dict[str, SpeedComparison]:
    """Prefill (batch 1 x `seqlen`) and decode speed of `path` against `baseline`, the two loaded at once and timed
    alternately (baseline, model, baseline, ...) so that machine load hits both; see `compare_prefill`.
    `checkpoints`: as for `evaluate_checkpoint`."""
    checkpoints = checkpoints or Checkpoints(dtype, device, trust_remote_code)
    dense, model = checkpoints.model(baseline), checkpoints.model(path)
    return {
        "prefill": compare_prefill(dense, model, seqlen=seqlen, rounds=rounds),
        "decode": compare_decode(dense, model, rounds=rounds),
    }


def _load_model(path: str | Path, dtype: torch.dtype, device: str | torch.device, trust_remote_code: bool) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def _pair_on_text(
    checkpoints: Checkpoints, baseline: str | Path, path: str | Path, dataset: Any
) -> tuple[Any, Any, torch.Tensor]:
    """(the baseline, the model at `path`, `dataset` tokenised with the baseline's tokenizer): what every comparison
    on text reads, both models at once since it needs both distributions at the same positions."""
    return checkpoints.model(baseline), checkpoints.model(path), checkpoints.tokens(baseline, load_texts(dataset))


def _layer_figures(report: dict[str, Any]) -> list[Any]:
    """The layer x layer figures the report's method draws from it (`CardSection.figures`); none for a report of a
    method this version does not know."""
    from ..registry import get_method_class
    from ..utils.errors import UnknownMethodError

    try:
        section = get_method_class(str(report.get("method"))).card_section(report)
    except UnknownMethodError:
        return []
    return list(section.figures) if section is not None else []


def bar_names(entries: Sequence[dict[str, Any]]) -> list[str]:
    """Each model's bar label: its folder's name, or its path where two folders share a name (dense/ and
    run2/dense/), whose bars would otherwise stand on one tick."""
    names = [Path(e["path"]).name for e in entries]
    return names if len(set(names)) == len(names) else [str(e["path"]) for e in entries]


def plot_comparison(entries: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Two panels: adjacent-layer input similarity from the compression report, and perplexity per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    label = "value"
    for entry in entries:
        for figure in _layer_figures(entry.get("flatten_report") or {})[:1]:
            matrix, label = figure.matrix, figure.value_label
            adjacent = [matrix[i][i + 1] for i in range(len(matrix) - 1)]
            left.plot(range(len(adjacent)), adjacent, marker="o", label=Path(entry["path"]).name)
            for group in figure.groups or []:
                if len(group) > 1:
                    left.axvspan(group[0] - 0.4, group[-1] - 0.6, color="red", alpha=0.15)
    left.set_xlabel("layer i (original index)")
    left.set_ylabel(f"layers i and i+1: {label}", fontsize=8)
    left.set_title("Adjacent layers (merged groups shaded)")
    if left.lines:
        left.legend()
    names = bar_names(entries)
    # Tokenizers that differ are compared by bits per byte on a common text: their perplexities are per different
    # tokens, and a figure of them would show the comparison the protocol says is not made.
    per_byte = all("bits_per_byte" in e for e in entries)
    key, title = ("bits_per_byte", "Bits per byte (common text)") if per_byte else ("perplexity", "Held-out perplexity")
    right.bar(names, [e[key] for e in entries], color=["grey", "tab:blue", "tab:orange"][: len(entries)])
    right.set_ylabel(key.replace("_", " "))
    right.set_title(title)
    fig.tight_layout()
    path = Path(path)
    try:
        write_atomically(path, fig.savefig)  # whole or not at all: a failed figure leaves the last one in place
    finally:
        plt.close(fig)
    return path
