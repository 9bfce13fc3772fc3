"""The teacher's text sampled by vLLM instead of transformers' ``generate`` (``sampling_backend="vllm"``): optional,
for a GPU where vLLM is installed; nothing else in the package needs vLLM.

Why, and what is kept equal to the transformers path (`recovery.teacher_text`):

- **Faster on a GPU.** vLLM's paged KV cache and continuous batching sample many more rows a second than ``generate``
  at one batch; healing on 1M tokens of the teacher's text is mostly sampling.
- **The same rows' shape and distribution**: every row is the start (and prompt) then exactly ``seqlen`` tokens in
  all, sampled at the given temperature with no top-k, top-p or min-p cut unless asked, no repetition penalty, and
  EOS an ordinary token: ``ignore_eos=True`` with ``max_tokens`` the rest of the row, and ``min_tokens=0``, because
  vLLM's ``min_tokens`` would *suppress* EOS (and every stop token) until it is reached, which is not the teacher's
  distribution. ``generation_config="vllm"`` keeps the model's generation_config.json from setting any default.
  The rows are a different draw than transformers' (another sampler, another random stream); the cache key names the
  backend, so the two never stand in for each other.
- **Seeded per row**: each request carries its own seed (from the run's seed, the stream, the rank and the row), so
  a row does not depend on how vLLM's scheduler batches it.
- **In a child process.** vLLM allocates a share of the GPU for its KV cache and keeps it until its process ends;
  freeing an engine inside a process that then trains is not reliable. So a spawned child loads the teacher *from
  its path* (vLLM has its own loader; the in-memory module is not shared), samples every row of this rank, writes
  them to a temporary file and exits, and the memory is the trainer's again. The child sees only the teacher's GPU
  and none of torchrun's variables, so under torch.distributed each rank runs its own engine on its own device. It
  is spawned (CUDA cannot be forked), which imports the calling script again: a script keeps its work under
  ``if __name__ == "__main__":``, as vLLM asks of its own.
- **Memory**: vLLM is given `VLLM_MEMORY_SHARE` of the memory free on the teacher's device when it starts (as a
  fraction of the device's total, which is how ``gpu_memory_utilization`` is read). What its processes peak at is not
  visible from here; the record says so and gives that budget.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Share of the teacher device's free memory vLLM may take (weights, activations, KV cache): the rest is the
#: trainer's process, which keeps the teacher (and the student) where they are while vLLM samples.
VLLM_MEMORY_SHARE = 0.8
#: What torchrun (and torch.distributed's env:// init) sets, and the child must not see: vLLM would read them as its
#: own distributed setup.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it: that initialises CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Refuses ``sampling_backend="vllm"`` in one line where vLLM is not installed (before any weight changes)."""
    if not vllm_installed():
        raise ImportError(
            "sampling_backend='vllm' needs vLLM installed (pip install vllm, on a machine with a GPU it supports); "
            "or leave sampling_backend='transformers'."
        )


def teacher_source(teacher: nn.Module) -> tuple[str, bool]:
    """(the folder or Hub id vLLM loads the teacher from, whether that needs trust_remote_code): the path the teacher
    was loaded from, since vLLM reads the weights itself. A teacher with remote code (an ``auto_map``) was loaded
    with trust_remote_code already, so vLLM is given the same trust."""
    config = getattr(teacher, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    if not source:
        raise ValueError(
            "sampling_backend='vllm' loads the teacher from its folder or Hub id, and this teacher has none "
            "(config._name_or_path is empty); save it with save_pretrained and load it from there, or use "
            "sampling_backend='transformers'."
        )
    return source, bool(getattr(config, "auto_map", None))


def sampling_params(new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``SamplingParams`` for one row (its seed added per row): every setting that
    shapes the distribution given explicitly, plain sampling unless asked (see the module docstring)."""
    return {
        "n": 1,
        "temperature": float(temperature),
        "top_k": int(top_k or 0),  # 0: no cut
        "top_p": float(top_p if top_p is not None else 1.0),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(new_tokens),
        "min_tokens": 0,  # vLLM's min_tokens suppresses EOS until reached
        "ignore_eos": True,
        "stop": None,
        "stop_token_ids": None,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def vllm_dtype(teacher: nn.Module) -> str:
    """The teacher's floating dtype as vLLM names it, so that vLLM samples at the precision the teacher runs at."""
    dtype = next((p.dtype for p in teacher.parameters() if p.is_floating_point()), torch.float32)
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def memory_share(device: torch.device) -> float | None:
    """``gpu_memory_utilization`` for the child: `VLLM_MEMORY_SHARE` of what is free on the teacher's CUDA device,
    as a share of its total; None off CUDA (vLLM's own default, on whatever device it finds)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return round(VLLM_MEMORY_SHARE * free / total, 4)


@contextlib.contextmanager
def child_environment(device: torch.device) -> Iterator[None]:
    """The environment a child process starts with: none of the launcher's variables, and on CUDA only the
    teacher's device visible (its physical index, read through this process's CUDA_VISIBLE_DEVICES). Restored
    afterwards."""
    saved = dict(os.environ)
    try:
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            visible = [v.strip() for v in saved.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _sample_in_child(job: dict[str, Any], out: str) -> None:
    """In the spawned child: vLLM loads the teacher and samples every row; the ids go to `out`, a failure's one line
    to ``out + ".error"``."""
    try:
        from safetensors.torch import save_file
        from vllm import LLM, SamplingParams

        engine = {"model": job["source"], "dtype": job["dtype"], "seed": job["seed"], "generation_config": "vllm",
                  "trust_remote_code": job["trust_remote_code"]}  # fmt: skip
        if job["memory_share"] is not None:
            engine["gpu_memory_utilization"] = job["memory_share"]
        llm = LLM(**engine)
        params = [SamplingParams(**job["sampling"], seed=seed) for seed in job["seeds"]]
        prompts = [{"prompt_token_ids": list(start)} for start in job["starts"]]
        outputs = llm.generate(prompts, params, use_tqdm=job["progress"])
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} rows for {len(prompts)} prompts")
        rows = [list(s) + list(o.outputs[0].token_ids) for s, o in zip(job["starts"], outputs, strict=True)]
        lengths = sorted({len(row) for row in rows})
        if lengths != [job["seqlen"]]:
            raise RuntimeError(f"vLLM returned rows of {lengths} tokens, not {job['seqlen']}")
        save_file({"input_ids": torch.tensor(rows, dtype=torch.long)}, out)
    except BaseException as error:  # the parent reads why; the exit code alone would not say
        Path(out + ".error").write_text(f"{type(error).__name__}: {error}".splitlines()[0], encoding="utf-8")
        raise SystemExit(1) from None


def sample_with_vllm(
    teacher: nn.Module,
    starts: torch.Tensor,
    seqlen: int,
    seeds: list[int],
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    progress: bool,
) -> tuple[torch.Tensor, int]:
    """(`starts` continued to `seqlen` tokens by vLLM in a spawned child, one seed a row; the bytes vLLM was given on
    the teacher's device, 0 off CUDA). Raises RuntimeError with the child's own one-line reason when it fails."""
    from safetensors import safe_open

    if len(seeds) != starts.shape[0]:
        raise ValueError(f"one seed a row: {len(seeds)} seeds for {starts.shape[0]} rows.")
    if starts.shape[0] == 0:
        return torch.empty((0, seqlen), dtype=torch.long), 0
    source, trust_remote_code = teacher_source(teacher)
    device = next(teacher.parameters()).device
    share = memory_share(device)
    job = {
        "source": source,
        "trust_remote_code": trust_remote_code,
        "dtype": vllm_dtype(teacher),
        "seed": int(seed),
        "memory_share": share,
        "sampling": sampling_params(seqlen - starts.shape[1], temperature, top_k, top_p),
        "seeds": [int(s) for s in seeds],
        "starts": starts.tolist(),
        "seqlen": int(seqlen),
        "progress": bool(progress),
    }
    with tempfile.TemporaryDirectory(prefix="flatten-vllm-") as folder:
        out = os.path.join(folder, "rows.safetensors")
        with child_environment(device):
            child = multiprocessing.get_context("spawn").Process(target=_sample_in_child, args=(job, out))
            child.start()
        child.join()
        error = Path(out + ".error")
        if child.exitcode != 0 or not Path(out).is_file():
            reason = error.read_text(encoding="utf-8") if error.is_file() else f"exit code {child.exitcode}"
            raise RuntimeError(f"sampling the teacher's text with vLLM failed: {reason}")
        with safe_open(out, framework="pt") as rows:
            ids = rows.get_tensor("input_ids")
    if tuple(ids.shape) != (starts.shape[0], seqlen) or not torch.equal(ids[:, : starts.shape[1]], starts.cpu()):
        raise RuntimeError(f"vLLM returned rows of shape {tuple(ids.shape)} that do not continue their starts.")
    budget = int(share * torch.cuda.mem_get_info(device)[1]) if share is not None else 0
    return ids, budget
