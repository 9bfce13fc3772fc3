"""Shared checkers and the one tolerance table of the test-suite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import tiny_models
from optimum_flatten import FlattenConfig, FlattenQuantizer
from tiny_models import VOCAB

#: Tolerances by dtype: (atol, rtol). float64 is used by the naive references, float32 by the tiny models.
TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
}


#: Unit roundoff u of IEEE round-to-nearest arithmetic: each +, -, *, / is exact up to a factor (1 + d), |d| <= u.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u) (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1).

    A dot product of length n computed in `dtype` in any order, with or without FMA, is within gamma_n |x|^T |y| of
    the exact one; so is every entry of a matrix product by any conventional BLAS kernel (blocked, vectorised,
    multithreaded: they only change the order). This is the bound a float32-vs-float64 test states instead of a
    constant tuned on one machine's BLAS.
    """
    nu = n * UNIT_ROUNDOFF[dtype]
    assert nu < 1, f"{n} terms are too many for a {dtype} error bound"
    return nu / (1 - nu)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    """|actual - expected| <= bound elementwise, compared in float64; the message gives the worst error / bound."""
    error = (actual.double() - expected.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(error)
    worst = float((error / bound).max())
    assert bool((error <= bound).all()), f"{what}: error up to {worst:.3g} x the derived bound ({error.max():.3g})"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol)


#: The suite's usual calibration: the tiny sample texts, 8 samples of 24 tokens (a few seconds per method on CPU).
TINY_CALIBRATION: dict[str, Any] = {"nsamples": 8, "seqlen": 24}

_CHAR_TOKENIZER = object()  # sentinel: "the character tokenizer", so that None can still mean "no tokenizer"


#: The small healing the teacher-text tests run: rows of 32 tokens (characters), 4 of them held out, a gate each step.
SMALL_HEALING = dict(seqlen=32, per_device_train_batch_size=2, heldout_rows=4, eval_every=1, learning_rate=1e-3)


def tiny_config(method: str, **options: Any) -> FlattenConfig:
    """A FlattenConfig for `method` calibrated on the tiny sample texts; `options` override or add to the defaults."""
    return FlattenConfig(method=method, **{"dataset": tiny_models.sample_texts(), **TINY_CALIBRATION, **options})


def tiny_recovery_config(**overrides: Any) -> Any:
    """A `RecoveryConfig` sized for the tiny models (256 tokens of 2 × 32-token rows, no gate, no progress bars);
    `overrides` replace or add fields."""
    from optimum_flatten.recovery import RecoveryConfig

    base = dict(
        max_tokens=256,
        seqlen=32,
        per_device_train_batch_size=2,
        heldout_rows=0,
        extra_training_args={"disable_tqdm": True},
    )
    return RecoveryConfig(**{**base, **overrides})


def compress(
    model: torch.nn.Module,
    method: str | FlattenConfig,
    tokenizer: Any = _CHAR_TOKENIZER,
    **options: Any,
) -> FlattenQuantizer:
    """Compresses `model` in place and returns the quantizer (its `report` and `plan` are what tests read).

    `method` is a method name (the config is `tiny_config(method, **options)`) or a ready FlattenConfig (then
    `options` must be empty). The tokenizer defaults to the tiny character tokenizer; pass None for a model whose
    calibration needs none (images, or a method without calibration). One helper instead of a build-config /
    build-quantizer / compress block in every test, so a change of the quantizer's API is made here once.
    """
    if isinstance(method, FlattenConfig):
        if options:
            raise TypeError(f"options {sorted(options)} given with a ready FlattenConfig; put them in the config.")
        config = method
    else:
        config = tiny_config(method, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    quantizer.compress(model, tiny_models.CharTokenizer() if tokenizer is _CHAR_TOKENIZER else tokenizer)
    return quantizer


def dense_and_compressed_on_disk(folder: Path, tokenizer: Any) -> tuple[Path, Path]:
    """(dense, compressed): a tiny LLaMA and `tokenizer` written as a user's dense checkpoint, and the same model
    compressed by FlattenGPT (2 layers) and written by `FlattenQuantizer.save`: what ``recover --teacher`` reads."""
    dense = folder / "dense"
    tiny_models.tiny_llama_gqa().save_pretrained(dense)
    tokenizer.save_pretrained(dense)
    model = tiny_models.tiny_llama_gqa()
    compressed = compress(model, "flattengpt", tokenizer, num_layers_to_remove=2).save(model, folder / "c", tokenizer)
    return dense, Path(compressed)


def sample_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@torch.no_grad()
def padded_batches(num: int, seed: int, padded: tuple[int, int, int]) -> list:
    """`num` calibration batches of 2 rows x 16 tokens; ``padded = (batch, row, count)`` right-pads `count` tokens of
    that row, so that every search over them meets a masked tail."""
    from optimum_flatten.calibration import CalibrationBatch

    batches = []
    for b in range(num):
        ids = sample_ids(batch=2, length=16, seed=seed + b)
        mask = torch.ones_like(ids)
        if b == padded[0]:
            mask[padded[1], -padded[2] :] = 0
        batches.append(CalibrationBatch(ids, mask))
    return batches


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def greedy_generate_both_ways(model, ids: torch.Tensor, new_tokens: int = 6):
    """Greedy generation with and without the KV cache."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without_cache = model.generate(ids, use_cache=False, **kwargs)
    return with_cache, without_cache


def shallower_reference(model, kept: list[int]):
    """A freshly built model of the same class holding only the `kept` layers (renumbered), copied from `model`.

    The independent reference for layer dropping: built from a config, not by editing the model under test.
    """
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [model.config.layer_types[i] for i in kept]
    reference = type(model)(config).to(torch.float32).eval()
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index not in kept:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{kept.index(index)}.", 1)
        state[name] = tensor
    reference.load_state_dict(state)
    return reference


def decoder_layers(model):
    """The layer list of a LLaMA-like (``model.layers``) or GPT-2 (``transformer.h``) causal LM."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def mlp_parts(layer):
    """(MLP module, its norm, its down projection weight as (out, in)) for LLaMA-like and GPT-2 blocks."""
    if hasattr(layer, "post_attention_layernorm"):
        return layer.mlp, layer.post_attention_layernorm, lambda: layer.mlp.down_proj.weight
    return layer.mlp, layer.ln_2, lambda: layer.mlp.c_proj.weight.T


@torch.no_grad()
def residual_streams(model, batches, end: int) -> list[torch.Tensor]:
    """Per batch, the residual stream of `model` after its first `end` layers, from full forwards:
    ``output_hidden_states[end]``, or the final norm's input when `end` is the layer count (the last hidden state
    transformers returns is already normalised)."""
    final_norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
    captured = {}
    handle = final_norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("out", args[0]))
    streams = []
    try:
        for batch in batches:
            hidden = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True
            ).hidden_states
            streams.append(captured["out"] if end == len(decoder_layers(model)) else hidden[end])
    finally:
        handle.remove()
    return streams


@torch.no_grad()
def naive_fit_rows(model, batches, layer: int, targets: int | list[torch.Tensor]):
    """The rows of the least-squares problems behind ReplaceMe-style maps, in float64, over every real token of
    `batches`, from full forwards of `model`: M, the MLP output of layer `layer`; Y, the residual stream entering
    that MLP's norm; L, the target (``residual_streams(model, batches, targets)`` when `targets` is an int, else
    one (batch, seq, hidden) tensor per batch, e.g. the dense model's stream when `model` is already bridged)."""
    if isinstance(targets, int):
        targets = residual_streams(model, batches, targets)
    mlp, norm, _ = mlp_parts(decoder_layers(model)[layer])
    captured = {}
    handles = [
        mlp.register_forward_hook(lambda _m, _a, out: captured.__setitem__("m", out)),
        norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("y", args[0])),
    ]
    ms, ys, ls = [], [], []
    try:
        for batch, target in zip(batches, targets, strict=True):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            keep = batch.attention_mask.bool()
            ms.append(captured["m"][keep].double())
            ys.append(captured["y"][keep].double())
            ls.append(target[keep].double())
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(ms), torch.cat(ys), torch.cat(ls)


def naive_least_squares_map(model, batches, layer: int, targets: int | list[torch.Tensor]) -> torch.Tensor:
    """T = argmin ||M T - (L - Y)|| by torch.linalg.lstsq on the rows of `naive_fit_rows` (ReplaceMe's formula)."""
    m, y, target = naive_fit_rows(model, batches, layer, targets)
    return torch.linalg.lstsq(m, target - y).solution


_REMOTE_RELOAD = """
import json, sys
from pathlib import Path
import torch
import transformers

out = {}
for name, job in json.loads(sys.argv[1]).items():
    config = json.loads((Path(job["path"]) / "config.json").read_text())
    auto = next(key for key in config["auto_map"] if key.startswith("AutoModel"))
    model = getattr(transformers, auto).from_pretrained(job["path"], trust_remote_code=True).eval()
    with torch.no_grad():
        result = getattr(model(**torch.load(job["inputs"])), job["field"])
    torch.save(result, job["output"])
    seen, count = set(), 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            count += parameter.numel()
    out[name] = {"auto": auto, "type": type(model).__name__, "parameters": count,
                 "model_type": model.config.model_type}
out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "optimum_flatten")
print(json.dumps(out))
"""


def reload_with_remote_code(jobs: dict[str, tuple[str, dict[str, torch.Tensor], str]], tmp_path) -> dict:
    """Loads each saved directory in a fresh interpreter through the Auto class its auto_map lists first, with
    ``trust_remote_code=True`` and without optimum_flatten on the way, and runs it on the given inputs.

    Args:
        jobs: name -> (checkpoint directory, model inputs, output field such as ``"logits"``).

    Returns:
        name -> {"auto", "type", "parameters", "model_type", "output" (the tensor)}, plus ``"imported"``: the
        optimum_flatten modules the interpreter had loaded (must be empty).
    """
    import json
    import os
    import subprocess
    import sys

    spec = {}
    for name, (path, inputs, field) in jobs.items():
        torch.save(inputs, tmp_path / f"{name}.inputs.pt")
        spec[name] = {
            "path": str(path),
            "inputs": str(tmp_path / f"{name}.inputs.pt"),
            "field": field,
            "output": str(tmp_path / f"{name}.output.pt"),
        }
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _REMOTE_RELOAD, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, job in spec.items():
        out[name]["output"] = torch.load(job["output"])
    return out


def assert_refused_before_any_change(model, method: str, message: str, **options: Any) -> None:
    """Compressing `model` with `options` raises a ValueError matching `message`, and no weight has changed."""
    import pytest

    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        compress(model, method, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def assert_reloads_with_plain_transformers(model, folder, report: dict | None = None) -> None:
    """`model` saved to `folder` by the product's own save and loaded back by plain transformers gives the same logits.

    The save is `export.checkpoint.save_compressed`, the door `FlattenQuantizer.save` and the CLI go through (it asks
    every registered method whether the model is its own), not `save_pretrained`, which skips those checks.
    """
    from transformers import AutoModelForCausalLM

    from optimum_flatten.export.checkpoint import save_compressed

    save_compressed(model, folder, report=report if report is not None else getattr(model, "flatten_report", None))
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits
        )


SRC = Path(__file__).resolve().parents[1] / "src"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_two_cpu_processes(
    arguments: list[str], timeout: int, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Runs ``torch.distributed.run --nproc_per_node 2 ARGUMENTS`` on the CPU (gloo, one thread a process), this
    checkout's src first on the path, and returns the finished process (both ranks' streams interleaved)."""
    environment = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # CPU, so gloo
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        environment["MASTER_ADDR"],
        "--master_port",
        environment["MASTER_PORT"],
        *arguments,
    ]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def launch_two_gloo_processes(script: Path, out: Path, timeout: int) -> None:
    """Runs `script OUT` as 2 processes under torch.distributed.run on the CPU (gloo), this checkout's src first on
    the path; fails the test with both streams' tails when the launch does."""
    done = torchrun_two_cpu_processes([str(script), str(out)], timeout)
    assert done.returncode == 0, f"the 2-process run failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def one_error_line(capsys: Any) -> str:
    """The one ``error:`` line a refused command printed to stderr (the test fails on none or several): what the
    command line promises for bad input."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def write_llama2_7b_config(folder: Path, **overrides: Any) -> None:
    """LLaMA-2-7B's config.json in `folder`, `overrides` replacing its fields (no weights: `estimate` reads nothing
    else, so the 7B shape costs no memory)."""
    import json

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **overrides,
    }
    (Path(folder) / "config.json").write_text(json.dumps(config))
