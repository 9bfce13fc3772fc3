"""Training rows the dense teacher writes itself, for healing by self-data distillation (Thangarasa et al. 2024,
arXiv 2410.09982): the compressed student learns the teacher's next-token distributions on text drawn from that same
distribution, so no user text is needed and the student is trained where the teacher actually puts its mass.

How the rows are sampled, and why:

- **Plain sampling at temperature 1, no top-k or top-p cut** unless asked. A cut renormalises the distribution over
  its head, and the rows would then show the student a narrower text than the teacher's own; a model's
  generation_config.json (SmolLM2-Instruct's, for one) and transformers' defaults (``top_k=50``) would apply such a
  cut silently, so every sampling setting is given to ``generate`` explicitly (`sampling_kwargs`).
- **Each row is exactly `seqlen` tokens**, the start token, the prompt (if any) and the continuation: ``min_new_tokens``
  and ``max_new_tokens`` are both the rest of the row, and **EOS is an ordinary token** (``eos_token_id=None`` for
  the generation, so nothing stops a row and nothing is suppressed): after an EOS the teacher starts a new document,
  as in the packed, EOS-separated rows of `recovery.data.build_training_rows`.
- **The start** (``start="bos"``, the default) is the tokenizer's BOS token, or its EOS token (a document separator)
  when it has no BOS: sampling from it draws from the model's unconditional distribution, whatever the model makes
  of a bare start. An instruct model was tuned to answer, not to continue a bare token: the bundled
  Qwen2.5-Coder-Instruct writes looping code and Chinese from it. ``start="chat"`` applies the tokenizer's chat
  template instead: a user turn holding the prompt (empty without one), then the assistant's turn opened, which the
  teacher writes (Thangarasa et al. regenerate the answers of an instruction set this way). With prompts, the first
  `prompt_tokens` tokens of each document follow the start token, or fill the user turn (the documents cycled in a
  seeded order). ``start="random"`` opens each row on a word drawn from the whole vocabulary, then the teacher's
  greedy next words, as LLM-QAT's data-free distillation does (`recovery.random_start`).
- **Labels** are the ids at every position, the prompt's included (they are the user's text, and the KL on them is
  still the teacher's distribution); the attention mask is all ones.
- **Seeded**: each batch forks torch's random state and seeds it from (seed, stream, rank, batch), so the same seed
  gives the same rows whatever ran before in the process (on the same device, with the same batch size), and the
  gate's held-out rows (another stream) are never training rows.
- **Cached** (`recovery.teacher_text_cache`): with a cache folder, the rows are written once (atomically, with a
  JSON key: the teacher's weights fingerprint, vocabulary, rows, seqlen, seed, sampling settings and prompts) and
  read back while the key matches, so a resumed healing does not sample again; another key samples again and
  replaces them.
- **Under torch.distributed** each rank samples its own share of the rows (its seeds mix in its rank), and the
  shares are gathered so that every rank holds all rows, in rank order, as the Trainer expects.

- **The sampler** is transformers' ``generate`` with the KV cache by default; ``backend="vllm"`` hands this rank's
  rows to vLLM in a child process where it is installed (`recovery.vllm_sampling`: faster on a GPU, the same rows'
  shape and distribution, another random draw, so the backend is part of the cache key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..utils.launch import all_ranks_min, all_ranks_sum, process_group
from .random_start import GREEDY_TOKENS, drawn_starts, first_tokens, greedy_kwargs
from .teacher_start import checked_start, prompt_ids
from .teacher_text_cache import FinishedBatches, cache_key, check_one_job, read_cache, write_cache
from .text_repetition import repetition_summary
from .vllm_sampling import require_vllm, sample_with_vllm, teacher_source

logger = logging.getLogger(__name__)

#: Most rows sampled at a time on a CPU. A decoding step there is bound by per-step overhead, not arithmetic:
#: SmolLM2-135M on one thread sampled 45, 109 and 157 tokens/s at 8, 32 and 64 rows (128 new tokens each,
#: 2026-11-28, a busy 2-core machine). The memory still sizes the batch below this (`default_batch_size`).
CPU_BATCH_SIZE = 64
#: Share of the free CUDA memory one sampling batch may take (the rest: the allocator's slack and temporaries).
SAMPLING_HEADROOM = 0.5
#: Most rows sampled at a time whatever the memory (beyond it a step's latency grows with no gain in throughput).
MAX_BATCH_SIZE = 256
#: Bytes a row's next-token step holds per vocabulary entry: the float32 logits, the processed scores, the softmax.
LOGIT_BYTES = 3 * 4

#: Who samples the rows: transformers' ``generate`` (always there), or vLLM where installed.
SAMPLING_BACKENDS = ("transformers", "vllm")

Row = dict[str, torch.Tensor]


def kv_cache_bytes(config: Any, seqlen: int, dtype_bytes: int) -> int:
    """Bytes of one row's KV cache at `seqlen` tokens: keys and values of every layer, ``2 · layers · kv_heads ·
    head_dim · seqlen · dtype bytes`` (read from a transformers config, its text config for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * seqlen * dtype_bytes


def sampling_batch_size(
    row_kv_bytes: int, vocab_size: int, free_bytes: int, headroom: float = SAMPLING_HEADROOM
) -> int:
    """Rows to sample at a time so that their KV caches and next-token logits take at most `headroom` of
    `free_bytes` (at least 1, at most `MAX_BATCH_SIZE`): the cache grows with every row, the logits are a step's."""
    per_row = row_kv_bytes + LOGIT_BYTES * vocab_size
    return max(1, min(MAX_BATCH_SIZE, int(headroom * free_bytes) // max(per_row, 1)))


def device_batch_size(row_kv_bytes: int, vocab_size: int, free_bytes: int, accelerator: bool) -> int:
    """`sampling_batch_size` of `free_bytes`, at most `CPU_BATCH_SIZE` rows off an accelerator (where a 7B row's
    cache is half a GB and more rows stop paying off sooner): the sampler's rule, which `estimate` sizes by too."""
    rows = sampling_batch_size(row_kv_bytes, vocab_size, free_bytes)
    return rows if accelerator else min(CPU_BATCH_SIZE, rows)


def default_batch_size(model: nn.Module, seqlen: int) -> int:
    """`device_batch_size` of the free memory of the teacher's device now."""
    from ..utils.memory import available_bytes

    parameter = next(model.parameters())
    row = kv_cache_bytes(model.config, seqlen, parameter.element_size())
    vocab = int(model.config.get_text_config().vocab_size)
    return device_batch_size(row, vocab, available_bytes(parameter.device), parameter.device.type == "cuda")


def sampling_kwargs(
    seqlen: int, prompt_length: int, temperature: float, top_k: int | None, top_p: float | None, pad_token_id: int
) -> dict[str, Any]:
    """What ``generate`` is given: every setting that shapes the distribution, set to plain sampling unless asked.

    Given as keyword arguments, which transformers applies over the model's generation_config.json and its own
    defaults (a `GenerationConfig` object passed instead has its None fields filled from them: ``top_k=50``, the
    model's EOS). ``top_k=0`` and ``top_p=1.0`` are transformers' "no cut"; ``eos_token_id=None`` makes EOS an
    ordinary token, so that every row runs to `seqlen` (see the module docstring)."""
    new = seqlen - prompt_length
    return {
        "do_sample": True,
        "use_cache": True,
        "num_beams": 1,
        "temperature": float(temperature),
        "top_k": int(top_k or 0),
        "top_p": float(top_p if top_p is not None else 1.0),
        "min_p": None,
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "bad_words_ids": None,
        "suppress_tokens": None,
        "begin_suppress_tokens": None,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": int(pad_token_id),
        "min_new_tokens": new,
        "max_new_tokens": new,
    }


def generation_config(
    seqlen: int, prompt_length: int, temperature: float, top_k: int | None, top_p: float | None, pad_token_id: int
) -> Any:
    """`sampling_kwargs` as an explicit transformers `GenerationConfig`, validated (what the record describes)."""
    from transformers import GenerationConfig

    config = GenerationConfig(**sampling_kwargs(seqlen, prompt_length, temperature, top_k, top_p, pad_token_id))
    config.validate(strict=True)
    return config


def batch_seed(seed: int, stream: str, rank: int, index: int) -> int:
    """The seed of one batch: a hash of (seed, stream, rank, batch), so that no two streams, ranks or seeds share a
    batch's random state (``seed + index`` would give seed 1's first batch to seed 0's second)."""
    digest = hashlib.sha256(f"{seed}:{stream}:{rank}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _share(n_rows: int, rank: int, world_size: int) -> int:
    """Rows rank `rank` samples of `n_rows`: an equal share, the first ranks one more for the remainder."""
    return n_rows // world_size + (1 if rank < n_rows % world_size else 0)


def _rank_rows(n_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(the index of rank `rank`'s first row among all ranks' rows, how many it samples)."""
    return sum(_share(n_rows, r, world_size) for r in range(rank)), _share(n_rows, rank, world_size)


def _gather(ids: torch.Tensor, n_rows: int, world_size: int, device: torch.device) -> torch.Tensor:
    """Every rank's rows, in rank order, on every rank (shares padded to the largest for all_gather; NCCL moves
    CUDA tensors only, so they travel on the teacher's device)."""
    if world_size == 1:
        return ids
    most = _share(n_rows, 0, world_size)
    padded = torch.zeros((most, ids.shape[1]), dtype=ids.dtype, device=device)
    padded[: ids.shape[0]] = ids.to(device)
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[: _share(n_rows, r, world_size)] for r, part in enumerate(parts)]).cpu()


def _rows_read_back(kept: Any, world_size: int) -> int:
    """Every rank's rows read back from finished batches (each keeps its own share's), as the record's `rows` counts
    every rank's rows. Whether there is a `kept` is the same on every rank (the cache, its key and the backend are),
    so every rank joins the sum."""
    read_back = int(kept.rows.shape[0]) if kept is not None and kept.rows is not None else 0
    if kept is not None and world_size > 1:
        read_back = all_ranks_sum(read_back)
    return read_back


def _peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they measure): CUDA's peak allocation since the sampling began, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    try:
        import resource  # not on Windows
    except ImportError:
        return 0, "not measured"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process peak RSS"


def _starts(
    n_rows: int,
    start: tuple[list[int], list[int]],
    prompts: list[list[int]] | None,
    seed: int,
    rank: int,
    world_size: int,
) -> torch.Tensor:
    """This rank's rows' beginnings: the start's tokens around its prompt (the prompts cycled in a seeded order, the
    whole run's rows dealt to the ranks in turn so that the prompts do not depend on the world size's split)."""
    before, after = start
    first, count = _rank_rows(n_rows, rank, world_size)
    if not prompts:
        return torch.tensor([*before, *after], dtype=torch.long).repeat(count, 1)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = [prompts[order[(first + i) % len(order)]] for i in range(count)]
    width = len(before) + len(prompts[0]) + len(after)
    return torch.tensor([[*before, *ids, *after] for ids in chosen], dtype=torch.long).view(count, width)


def _cached_rows(
    folder: Path | None, stream: str, key: dict[str, Any] | None, world_size: int
) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
    """(rows, what sampling them cost) from the cache, or (None, None) where this process must sample: no cache, or
    under torch.distributed a rank without it (another node's folder), since the others must then sample with it."""
    found = read_cache(folder, stream, key) if folder is not None and key is not None else None
    if world_size > 1 and not all_ranks_min(int(found is not None)):  # on every rank, or sampled on every rank
        found = None
    return found if found is not None else (None, None)


def _measuring(device: torch.device) -> float:
    """The clock's start of a sampling, with the device's peak memory counted from here (`_sampling_cost`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def _sampling_cost(
    began: float, generated: int, device: torch.device, processes: int, vllm_bytes: int | None = None
) -> dict[str, Any]:
    """What the sampling since `began` cost: measured once, for the record and for the cache beside the rows. With
    vLLM (`vllm_bytes`: what it was given) the memory is that budget: its own processes' peak is not visible here."""
    seconds = time.perf_counter() - began
    peak, measured = _peak_memory(device)
    if vllm_bytes is not None:
        peak, measured = vllm_bytes, "the memory vLLM was given (gpu_memory_utilization); its peak is not measured"
    return {"processes": processes, "seconds": round(seconds, 3),
            "tokens_per_second": round(generated / seconds, 1) if seconds > 0 else None,
            "peak_memory_bytes": peak, "peak_memory": measured}  # fmt: skip


def _generate(
    teacher: nn.Module,
    starts: torch.Tensor,
    seqlen: int,
    kwargs: dict[str, Any],
    batch_size: int,
    seed: int,
    stream: str,
    rank: int,
    progress: bool,
    kept: FinishedBatches | None = None,
) -> torch.Tensor:
    """`starts` continued to `seqlen` tokens, `batch_size` rows at a time, each batch under its own seed; with `kept`,
    after the rows its stopped sampling finished (whole batches), handing it the rows so far after each batch."""
    from tqdm.auto import tqdm

    device = next(teacher.parameters()).device
    new_tokens = seqlen - starts.shape[1]
    outputs = [kept.rows] if kept is not None and kept.rows is not None else []
    done = int(outputs[0].shape[0]) if outputs else 0
    # The kept rows were `kept.batches` batches: the next draws from the next index's seed, which with an unchanged
    # batch size is the index a sampling never stopped gives it.
    batches_before = kept.batches if outputs else 0
    desc = "the model's own calibration text" if stream == "calibration" else "teacher text"
    bar = tqdm(total=starts.shape[0] * new_tokens, unit="tok", desc=desc, disable=not progress)
    bar.update(done * new_tokens)
    with bar:
        for index, first in enumerate(range(done, starts.shape[0], batch_size), start=batches_before):
            batch = starts[first : first + batch_size].to(device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(batch_seed(seed, stream, rank, index))
                out = teacher.generate(input_ids=batch, attention_mask=torch.ones_like(batch), **kwargs)
            if out.shape[1] != seqlen:
                raise RuntimeError(f"the teacher's generate returned rows of {out.shape[1]} tokens, not {seqlen}.")
            outputs.append(out.cpu())
            if kept is not None:
                kept.save(torch.cat(outputs), index + 1, batch_size)
            bar.update(batch.shape[0] * new_tokens)
    return torch.cat(outputs) if outputs else torch.empty((0, seqlen), dtype=torch.long)


def _continue(
    teacher: nn.Module,
    starts: torch.Tensor,
    seqlen: int,
    kwargs: dict[str, Any],
    batch_size: int | None,
    seed: int,
    stream: str,
    rank: int,
    progress: bool,
    kept: FinishedBatches | None = None,
) -> tuple[torch.Tensor, int | None]:
    """(this rank's `starts` continued to `seqlen` tokens, the bytes vLLM was given or None): by ``generate`` in
    batches (`batch_size` given; going on after `kept`'s finished batches), else by vLLM with one seed a row
    (`kwargs` hold the sampling either way)."""
    if batch_size is None:
        seeds = [batch_seed(seed, stream, rank, row) for row in range(starts.shape[0])]
        return sample_with_vllm(
            teacher, starts, seqlen, seeds, temperature=kwargs["temperature"], top_k=kwargs["top_k"],
            top_p=kwargs["top_p"], seed=seed, progress=progress,
        )  # fmt: skip
    was_training = teacher.training
    teacher.eval()
    try:
        return _generate(teacher, starts, seqlen, kwargs, batch_size, seed, stream, rank, progress, kept), None
    finally:
        teacher.train(was_training)


def _batch_size(
    given: int | None, backend: str, kept: FinishedBatches | None, teacher: nn.Module, seqlen: int
) -> int | None:
    """The rows a ``generate`` call: as given; else the free memory's now (`default_batch_size`), or a stopped
    sampling's kept batches' where they still fit (`FinishedBatches.resumed_batch_size`); None for vLLM."""
    if backend != "transformers":
        return None
    if given:  # 0 as None, as before
        return given
    default = default_batch_size(teacher, seqlen)
    return kept.resumed_batch_size(default) if kept is not None else default


def _settings(
    seed: int,
    stream: str,
    temperature: float,
    top_k: int,
    top_p: float | None,
    start_kind: str,
    prompt_tokens: int,
    prompted: bool,
    backend: str = "transformers",
) -> dict[str, Any]:
    """The sampling settings a record (and the cache key) holds: what makes another sample of the same rows. The
    backend is named only when it is not transformers', so that caches written before vLLM was offered stay valid."""
    backend_entry = {} if backend == "transformers" else {"backend": backend}
    return {
        **backend_entry,
        "seed": int(seed),
        "stream": stream,
        "temperature": float(temperature),
        "top_k": top_k or None,
        "top_p": top_p if top_p is not None and top_p < 1.0 else None,
        "start": "prompts" if prompted and start_kind != "chat" else start_kind,
        "prompt_tokens": prompt_tokens if prompted else None,
        "eos": "an ordinary token (rows run to seqlen)",
    }


def _check_backend(backend: str, teacher_model: nn.Module) -> None:
    """Refuses an unknown sampling backend, and vLLM where it is not installed or the teacher has no folder to load
    from (before anything is sampled)."""
    if backend not in SAMPLING_BACKENDS:
        raise ValueError(f"sampling backend is one of {', '.join(SAMPLING_BACKENDS)}, got {backend!r}.")
    if backend == "vllm":
        require_vllm()
        teacher_source(teacher_model)


def _random_starts(
    teacher_model: nn.Module,
    tokenizer: Any,
    before: list[int],
    n_rows: int,
    kwargs: dict[str, Any],
    batch_size: int,
    seed: int,
    stream: str,
) -> torch.Tensor:
    """This rank's rows of the random start (`recovery.random_start`): a drawn word after `before`, then the teacher's
    `GREEDY_TOKENS` greedy words, through `generate` whatever the backend that samples the rest."""
    rank, world_size = process_group()
    candidates = first_tokens(tokenizer, teacher_model.get_input_embeddings().num_embeddings)
    drawn = drawn_starts(before, candidates, n_rows, _rank_rows(n_rows, rank, world_size),
                         seed=batch_seed(seed, f"{stream}:first-token", 0, 0))  # fmt: skip
    length = drawn.shape[1] + GREEDY_TOKENS
    starts, _ = _continue(teacher_model, drawn, length, greedy_kwargs(kwargs), batch_size, seed, stream, rank, False)
    return starts


def sample_teacher_rows(
    teacher_model: nn.Module,
    tokenizer: Any,
    n_rows: int,
    seqlen: int,
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    prompts: Any = None,
    prompt_tokens: int = 32,
    start: str = "bos",
    batch_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    stream: str = "train",
    progress: bool = True,
    backend: str = "transformers",
    distributed: bool = True,
    one_job: bool = False,
) -> tuple[list[Row], dict[str, Any]]:
    """`n_rows` training rows of `seqlen` tokens sampled from `teacher_model` (see the module docstring), and a
    record of the sampling.

    Args:
        teacher_model: The dense model (eval mode, on the device it samples on).
        tokenizer: Its tokenizer (the start token; the prompts' tokens).
        n_rows, seqlen: How many rows, of how many tokens each (start token and prompt included).
        seed: The rows' seed (with `stream`, and the rank under torch.distributed).
        temperature, top_k, top_p: Sampling (defaults: temperature 1, no cut).
        prompts: None (every row from the start token), a list of texts, or a file / text source.
        prompt_tokens: Tokens of each prompt document kept.
        start: ``"bos"``, ``"chat"`` (`teacher_start.row_start`) or ``"random"`` (`recovery.random_start`; no prompts).
        batch_size: Rows a ``generate`` call; None: the free memory's (`_batch_size`; vLLM batches its own rows).
        cache_dir: Folder to keep the rows in (under `stream`'s name) and read them back from.
        stream: Which rows these are (``"train"``, ``"heldout"``): another stream draws other rows.
        progress: Show a progress bar in tokens.
        backend: ``"transformers"`` (``generate``) or ``"vllm"`` (`recovery.vllm_sampling`, where installed).
        distributed: True shares the rows out over a process group's ranks (seeded by rank; all get every row);
            False samples them all on each rank as one process would (`recovery.own_calibration`).
        one_job: `cache_dir` is one job's resume folder: rows kept there under another key are refused
            (`teacher_text_cache.check_one_job`) instead of sampled again over them.

    Returns:
        (rows as `build_training_rows` makes them, record: seconds, tokens (and those generated), the tokens each
        row holds before the teacher samples (``opening_tokens``: start and prompt), generated tokens a second, peak
        memory and what it measures, rows, seed, sampling settings, start, batch size, whether the rows came from the
        cache, and for cached rows what sampling them cost, ``sampled``).

    Raises:
        CalibrationDataError: no start token and no prompts, or no prompt long enough.
        ValueError: a row too short for its start token and prompt, an unknown backend, or vLLM with a teacher
            that has no path to load from.
        ImportError: ``backend="vllm"`` where vLLM is not installed.
    """
    _check_backend(backend, teacher_model)
    prompt_list = prompt_ids(tokenizer, prompts, prompt_tokens) if prompts is not None else None
    before, after, start_kind, prompt_length = checked_start(tokenizer, start, seqlen, prompt_tokens, bool(prompt_list))
    pad = getattr(tokenizer, "pad_token_id", None)
    kwargs = sampling_kwargs(seqlen, prompt_length, temperature, top_k, top_p, before[0] if pad is None else int(pad))
    settings = _settings(
        seed, stream, temperature, kwargs["top_k"], top_p, start_kind, prompt_tokens, bool(prompt_list), backend
    )
    if start_kind == "chat":  # another template writes other rows
        settings["start_tokens"] = hashlib.sha256(json.dumps([before, after]).encode()).hexdigest()[:16]
    device = next(teacher_model.parameters()).device
    rank, world_size = process_group() if distributed else (0, 1)
    folder = Path(cache_dir) if cache_dir is not None else None
    key = cache_key(teacher_model, tokenizer, n_rows, seqlen, settings, prompt_list) if folder is not None else None
    if one_job and folder is not None and key is not None:
        check_one_job(folder, stream, key)
    began = _measuring(device)
    ids, sampled = _cached_rows(folder, stream, key, world_size)
    cached, vllm_bytes = ids is not None, None
    kept = None if cached or backend != "transformers" else FinishedBatches.open(folder, stream, key, rank, world_size)
    batch_size = _batch_size(batch_size, backend, kept, teacher_model, seqlen)  # vLLM: None, it batches its own
    generated = n_rows * (seqlen - prompt_length + (GREEDY_TOKENS if start_kind == "random" else 0))
    if ids is None:
        if start_kind == "random":
            greedy_batch = batch_size or default_batch_size(teacher_model, seqlen)
            starts = _random_starts(teacher_model, tokenizer, before, n_rows, kwargs, greedy_batch, seed, stream)
        else:
            starts = _starts(n_rows, (before, after), prompt_list, seed, rank, world_size)
        mine, vllm_bytes = _continue(
            teacher_model, starts, seqlen, kwargs, batch_size, seed, stream, rank, progress, kept
        )
        ids = _gather(mine, n_rows, world_size, device)
    read_back = _rows_read_back(kept, world_size)  # sampled by an earlier attempt: not in this attempt's seconds
    cost = _sampling_cost(began, generated - read_back * generated // n_rows, device, world_size, vllm_bytes)
    cost.update({"rows_read_back": read_back} if read_back else {})
    if not cached and folder is not None and key is not None and rank == 0:
        write_cache(folder, stream, key, ids, cost)
    if kept is not None:
        kept.clear()
    counts = {"batch_size": batch_size, "cached": cached, "generated": generated, "opening": prompt_length}
    record = _record(tokenizer, ids, seqlen, settings, cost, counts, sampled)
    if record["excerpts"]:
        logger.info("the teacher's text (%s rows), its first row begins: %r", stream, record["excerpts"][0])
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]
    return rows, record


def _record(
    tokenizer: Any,
    ids: torch.Tensor,
    seqlen: int,
    settings: dict[str, Any],
    cost: dict[str, Any],
    counts: dict[str, Any],
    sampled: dict[str, Any] | None,
) -> dict[str, Any]:
    """`sample_teacher_rows`' record of its rows: their settings and cost, the batch size (None: vLLM's scheduler
    batched them), whether they were read back (then no tokens a second, and ``sampled``: what sampling them cost),
    the tokens generated and opening each row, two excerpts and how much the rows repeat."""
    batch_size, cached, opening = counts["batch_size"], counts["cached"], counts["opening"]
    return {
        "rows": int(ids.shape[0]), "seqlen": int(seqlen), **settings,
        "batch_size": int(batch_size) if batch_size else None,
        "cached": cached, **cost,
        "tokens_per_second": None if cached else cost["tokens_per_second"],
        "tokens": int(ids.numel()), "generated_tokens": counts["generated"], "opening_tokens": opening,
        "excerpts": excerpts(tokenizer, ids),
        "repetition": repetition_summary(ids, skip=opening),
        **({"sampled": sampled} if sampled is not None else {}),
    }  # fmt: skip


#: Rows, and tokens of each, the record quotes.
EXCERPT_ROWS, EXCERPT_TOKENS = 2, 48


def excerpts(tokenizer: Any, ids: torch.Tensor) -> list[str]:
    """The first tokens of the first rows, decoded: what the teacher wrote, for a person to read in the log. A
    model's own text is its distribution, whatever that is (a coder model writes code, a multilingual one other
    languages), and that decides what healing on it can teach. Nothing from a tokenizer that cannot decode."""
    if not callable(getattr(tokenizer, "decode", None)):
        return []
    return [tokenizer.decode(row[:EXCERPT_TOKENS].tolist(), skip_special_tokens=True) for row in ids[:EXCERPT_ROWS]]


def is_teacher_dataset(dataset: Any) -> bool:
    """Whether `dataset` asks for the teacher's own text only: ``"teacher"`` (the command line's default ``--dataset
    teacher``), or None (no text given: the dense model writes its own; benchmarks/RESULTS.md says where that helped
    and where it did not)."""
    return dataset is None or (isinstance(dataset, str) and dataset.strip().lower() == "teacher")


def heldout_split(heldout_rows: int, share: float) -> tuple[int, int]:
    """(user rows, teacher rows) of the gate's `heldout_rows`: the training share, at least one row of each part
    when both are trained on and there are two rows to hold out. A negative count is refused: read as 0 it would
    turn the gate off without a word, which only 0 asks for."""
    if heldout_rows < 0:
        raise ValueError(f"heldout_rows must be at least 0 (0 turns the gate off), got {heldout_rows}.")
    if heldout_rows == 0 or share <= 0:
        return heldout_rows, 0
    if share >= 1:
        return 0, heldout_rows
    teacher = round(share * heldout_rows)
    if heldout_rows >= 2:
        teacher = min(max(teacher, 1), heldout_rows - 1)
    return heldout_rows - teacher, teacher
