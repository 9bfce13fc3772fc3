"""Does healing help, in domain and out of it? SmolLM2-135M compressed 30 -> 24, then healed on a token budget.

Protocol (one run = one method x mode x loss x budget):
- compress the bundled SmolLM2-135M, 6 of 30 layers removed, with a variant of benchmarks/depth/run.py (`--method`:
  `flattengpt` (today's defaults), `replaceme`, `auto`, `auto_down`, ...), calibrated as that benchmark does: 32 x 512
  packed tokens of the State of the Union speeches before 2000, seed 0, batches of 8;
- heal with `recover` (`--mode` lora / changed / local / last_k / full; `--kd` distils from the dense model, KL at
  `--temperature`, else the LM loss alone; `local` needs `--kd`: each changed span against the dense model's states,
  the gate on the KL, `--local-then-global-tokens` for a global phase after it) on `--max-tokens` tokens of the same
  pre-2000 speeches *outside the calibration windows*: the speeches are packed into one token stream exactly as
  calibration packs them, the 32 windows calibration drew are found in it (by content, so the benchmark cannot drift
  from calibration's draw), and the training text is the decoded runs of tokens between them (re-tokenised by
  `recover`; a few tokens at each seam may tokenise differently, none is a calibration token). The gate holds out
  `--heldout-rows` rows of that text;
- measure, before and after healing, against the dense model on the speeches from 2000 on and on the King James
  Bible (first `--eval-tokens` tokens each, windows of 512, no overlap, no BOS): perplexity ratio to dense,
  KL(dense ‖ model) and top-1 agreement (`evaluation.fidelity`, which gives both models' perplexity on the same
  tokens), and greedy-continuation agreement (`evaluation.generation`: 16 prompts of 64 tokens from those tokens,
  32 generated each, share equal to the dense model's and the mean agreeing prefix; wording continues: the same
  tokens); healing wall time and the process's peak RSS.

Teacher text. `--teacher-text SHARE` (needs `--kd`) trains on rows the dense model samples itself (self-data
distillation, `recovery.teacher_text`: temperature 1 unless `--sampling-temperature`, no top-k or top-p cut, from
the BOS token, never from the evaluation texts) for that share of the training rows, the rest from the speeches;
1.0 reads no speech at all. The sampling's record (seconds, peak memory, tokens/s) is in the result, and the file
name ends in ``_teacher<SHARE>``.

Learning rate. `--sweep-learning-rates 1e-4 3e-4 ...` compresses once, then heals a copy at each rate and records
only the gate's held-out objective *of the training text* (its held-out rows; the evaluation texts are not even
loaded), so that a rate is picked without looking at what is reported. It writes
benchmarks/results/lrsweep_<model>_<method>_<mode>_<kd|lm>_<tokens>.json. `--sweep-global-learning-rates` does
the same for the global phase after `--local-then-global-tokens` (the local phase at its default rate each time;
`..._global<N>_globalrates.json`); `--global-learning-rate` sets that phase's rate in a measured run.

Usage:
  python -m benchmarks.recovery.run --method flattengpt --mode changed --kd --max-tokens 262144
  python -m benchmarks.recovery.run --method flattengpt --mode lora --max-tokens 262144   # today's LM-loss LoRA
  python -m benchmarks.recovery.run --method flattengpt --mode local --kd --max-tokens 16384 \
      --sweep-learning-rates 3e-5 1e-4 3e-4 1e-3
Writes benchmarks/results/recovery_<model>_<method>_<mode>_<kd|lm>_<tokens>.json unless --out is given (`--model`:
smollm2, 6 of 30 removed, qwen2.5-0.5b, 5 of 24, or gemma3-270m, 4 of 18: the depths of their tables in
RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.depth import run as depth_run
from benchmarks.recovery import protocol

#: The compression variants of benchmarks/depth/run.py (one definition, so a method here is the same as there).
VARIANTS = depth_run.VARIANTS


#: Layers removed from each bundled model: the depth of its product table in RESULTS.md.
DEPTHS = {"smollm2": 6, "qwen2.5-0.5b": 5, "gemma3-270m": 4}
# The default protocol (`protocol.py`): evaluation tokens by model (a row measured on other tokens is not comparable
# with its table's rows), the training rows and the seed of every published run unless its file name says otherwise
# (`_variant`).
EVAL_TOKENS, DEFAULT_ROWS, DEFAULT_SEED = protocol.EVAL_TOKENS, protocol.TRAINING_ROWS, protocol.SEED
#: Tokens of each paragraph the dense model continues with --teacher-prompts (RecoveryConfig's default).
PROMPT_TOKENS = 32
UNRECORDED_ARGUMENTS = (
    "out",
    "threads",
    "checkpoint_dir",
    "save_every",
    "keep_checkpoints",
    "prompt_texts",
    "guard_texts",
    "calibration_texts",
    "calibration_cache",
)
CALIBRATION = dict(dataset="sotu:before-2000", nsamples=32, seqlen=512, seed=0, batch_size=8)


def training_texts(
    tokenizer: object, calibration: Any = None, own_text: float = 0.0, seed: int = 0
) -> tuple[list[str], dict]:
    """The pre-2000 speeches minus calibration's windows, as texts, and what was excluded. With a mixed calibration
    (`calibration`: the texts `depth_run.calibration_dataset` gave) every speech it read is left out whole: its
    windows were drawn from a stream of two texts, which the speeches alone do not pack into. With `own_text` (and
    its calibration `seed`) the windows are the fewer ones drawn beside the dense model's rows: the product draws
    ``nsamples`` less its own rows with the same seed (`build_calibration_batches`)."""
    from optimum_flatten.bundled import load_corpus

    if isinstance(calibration, list):  # a mix, or the dense model's text alone (then no speech is left out)
        read = set(calibration)
        speeches = load_corpus(CALIBRATION["dataset"])
        kept = [text for text in speeches if text not in read]
        return kept, {"calibration_speeches": len(speeches) - len(kept), "speeches": len(speeches)}
    from optimum_flatten.calibration.data import build_calibration_batches
    from optimum_flatten.config import CalibrationConfig
    from optimum_flatten.evaluation import tokenize_corpus

    stream = tokenize_corpus(tokenizer, load_corpus(CALIBRATION["dataset"]))
    seqlen = CALIBRATION["seqlen"]
    windows = stream[: (stream.numel() // seqlen) * seqlen].view(-1, seqlen)
    drawn = CalibrationConfig(**{**CALIBRATION, "seed": seed})
    if own_text:
        from optimum_flatten.recovery.own_calibration import own_row_count

        drawn = CalibrationConfig(
            **{
                **CALIBRATION,
                "seed": seed,
                "nsamples": drawn.nsamples - own_row_count(CalibrationConfig(**{**CALIBRATION, "own_text": own_text})),
            }
        )
    rows = torch.cat([b.input_ids for b in build_calibration_batches(tokenizer, drawn)])
    used = sorted({int(i) for row in rows for i in (windows == row).all(-1).nonzero().flatten()})
    if len(used) != rows.shape[0]:
        raise RuntimeError(f"found {len(used)} of calibration's {rows.shape[0]} windows in the stream; packing changed")
    texts, start = [], 0
    for index in [*used, windows.shape[0]]:
        end = index * seqlen if index < windows.shape[0] else stream.numel()
        if end > start:
            texts.append(tokenizer.decode(stream[start:end].tolist()))
        start = (index + 1) * seqlen
    excluded = {"calibration_windows": used, "window_tokens": seqlen, "stream_tokens": int(stream.numel())}
    return texts, excluded


def compression_calibration(args: argparse.Namespace) -> dict[str, Any]:
    """The compression's calibration options: `CALIBRATION`, on ``--calibration``'s texts (kept in
    ``args.calibration_texts``, None for the speeches), with ``--own-text`` that share of the sequences the dense
    model's own (`CalibrationConfig.own_text`, its seed ``--calibration-seed``)."""
    args.calibration_texts = None if args.calibration == "sotu" else calibration_texts(args)
    own = {"own_text": args.own_text, "seed": args.calibration_seed} if args.own_text else {}
    return {**CALIBRATION, "dataset": args.calibration_texts or CALIBRATION["dataset"], **own}


def calibration_texts(args: argparse.Namespace) -> list[str]:
    """The mixed calibration texts of ``--calibration`` (`benchmarks/depth/run.py`'s choices), sampled once per
    ``--calibration-cache`` folder."""
    return depth_run.calibration_dataset(args.calibration, args.model, args.calibration_cache, args.calibration_seed)


def untrained_scores(args: argparse.Namespace, measure_untrained: Callable[[], dict]) -> dict:
    """The compressed, untrained model's scores (`measure_untrained()`). With --checkpoint-dir they are kept there
    (``untrained.json``) and read back by a resumed run, which compresses the same model again (the compression is
    seeded) but skips its evaluation: 10-15 minutes of a Qwen2.5 resume on busy cores. Another model, method or
    evaluation budget measures afresh."""
    from optimum_flatten.utils.files import write_atomically

    if not args.checkpoint_dir:
        return measure_untrained()
    path = Path(args.checkpoint_dir) / "untrained.json"
    key = {"model": args.model, "method": args.method, "eval_tokens": args.eval_tokens}
    if getattr(args, "calibration", "sotu") != "sotu":  # runs from before the option kept their key
        key["calibration"] = args.calibration
    if getattr(args, "own_text", 0.0):
        key["own_text"], key["calibration_seed"] = args.own_text, args.calibration_seed
    elif getattr(args, "calibration_seed", 0):  # a mixed calibration's rows, another seed's untrained scores
        key["calibration_seed"] = args.calibration_seed
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["scores"]
    scores = measure_untrained()
    write_atomically(path, lambda temporary: temporary.write_text(json.dumps({"key": key, "scores": scores})))
    return scores


#: Dense greedy continuations per evaluation text, generated once per run (the dense model does not change).
_DENSE_CONTINUATIONS: dict[str, torch.Tensor] = {}


def measure(dense: torch.nn.Module, model: torch.nn.Module, streams: dict, eval_tokens: int) -> dict:
    """Perplexity ratio, KL, top-1 and greedy-continuation agreement of `model` against `dense` on each text."""
    from optimum_flatten.evaluation import fidelity, generation_agreement
    from optimum_flatten.evaluation.generation import greedy_continuations, held_out_prompts

    result = {}
    for name, tokens in streams.items():
        f = fidelity(dense, model, tokens, seqlen=512, max_tokens=eval_tokens)
        # Prompts from the scored part of the stream only, so generation reads no other text than the metrics.
        scored = tokens.reshape(-1)[:eval_tokens]
        if name not in _DENSE_CONTINUATIONS:
            _DENSE_CONTINUATIONS[name] = greedy_continuations(dense, held_out_prompts(scored, 16, 64), 32)
        g = generation_agreement(None, model, scored, 16, 64, 32, reference=_DENSE_CONTINUATIONS[name])
        result[name] = {
            "ppl_ratio": math.exp(f.compressed_nll - f.dense_nll),
            "perplexity": math.exp(f.compressed_nll),
            "dense_perplexity": math.exp(f.dense_nll),
            "kl": f.kl,
            "top1_agreement": f.top1_agreement,
            "scored_tokens": f.scored_tokens,
            "greedy_token_agreement": g.token_agreement,
            "greedy_agreeing_prefix": g.mean_agreeing_prefix,
            "greedy_protocol": g.protocol(),
        }
    return result


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (its own function, so the tests read the names runs get from the same options)."""
    from optimum_flatten.recovery import MODES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(DEPTHS), help="a bundled model; depth: DEPTHS")
    parser.add_argument("--method", default="flattengpt", help="a variant of benchmarks/depth/run.py")
    parser.add_argument("--mode", default="changed", choices=MODES)
    parser.add_argument("--kd", action="store_true", help="distil from the dense model (else the LM loss alone)")
    parser.add_argument(
        "--calibration",
        default="sotu",
        choices=sorted(depth_run.CALIBRATIONS),
        help="the compression's calibration text (benchmarks/depth/run.py's choices); a mixed one leaves every speech "
        "it read out of the healing text",
    )
    parser.add_argument("--calibration-cache", default=None, help="folder keeping the dense model's calibration rows")
    parser.add_argument("--calibration-seed", type=int, default=0, help="the seed of the dense model's rows")
    parser.add_argument(
        "--own-text",
        type=float,
        default=0.0,
        help="compress with CalibrationConfig.own_text: that share of the calibration sequences the dense model's "
        "own (seed --calibration-seed); the healing text leaves out the windows drawn beside them",
    )
    parser.add_argument("--max-tokens", type=int, default=65536, help="training token budget")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kd-alpha", type=float, default=1.0)
    parser.add_argument("--hidden-weight", type=float, default=0.0)
    parser.add_argument(
        "--state-loss", default="pooled", choices=["pooled", "per_token"], help="local mode / hidden terms"
    )
    parser.add_argument("--last-k", type=int, default=3)
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="default: the mode's, scaled to the model's weights (RecoveryConfig.rate_for)",
    )
    parser.add_argument("--local-then-global-tokens", type=int, default=None, help="local: then a global phase")
    parser.add_argument(
        "--global-scope", default="spans", choices=["spans", "all"], help="what the global phase trains"
    )
    parser.add_argument(
        "--global-learning-rate", type=float, default=None, help="the global phase's (default: the scope's mode's)"
    )
    parser.add_argument("--sweep-learning-rates", type=float, nargs="+", default=None, help="see the docstring")
    parser.add_argument(
        "--sweep-global-learning-rates",
        type=float,
        nargs="+",
        default=None,
        help="as --sweep-learning-rates, for the global phase after --local-then-global-tokens",
    )
    parser.add_argument("--warmup-ratio", type=float, default=0.0, help="share of the steps warming the rate up (< 1)")
    parser.add_argument("--seqlen", type=int, default=DEFAULT_ROWS["seqlen"], help="tokens per training row")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_ROWS["batch_size"], help="training rows per step")
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="the healing's seed: its held-out rows and the order of the training rows",
    )
    parser.add_argument(
        "--freeze-embeddings",
        action="store_true",
        help="keep the token embeddings and the LM head as they are (RecoveryConfig.train_embeddings=False)",
    )
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--patience", type=int, default=4)
    parser.add_argument("--heldout-rows", type=int, default=16)
    parser.add_argument("--eval-tokens", type=int, default=None, help="default: the model's table's (EVAL_TOKENS)")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint the healing here every --save-every steps, and resume it from there when the folder holds "
        "one (a run longer than a session; the result is the same as one uninterrupted run); the untrained "
        "model's scores are kept there too, so a resume skips their evaluation (`untrained_scores`)",
    )
    parser.add_argument("--save-every", type=int, default=64, help="optimiser steps between checkpoints")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the healing's checkpoints in --checkpoint-dir once the result is written (default: deleted then, "
        "as a 1M-token run's fill gigabytes; the untrained scores and the dense model's samples stay)",
    )
    parser.add_argument(
        "--teacher-text",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share (0..1) of the training rows the dense model samples itself (needs --kd); 1.0 reads no speech",
    )
    parser.add_argument(
        "--teacher-text-cache",
        default=None,
        metavar="DIR",
        help="folder the dense model's samples are kept in and read back from (the same rows for every method and "
        "every rerun with the same teacher, seed and row count; default: none, or the checkpoint folder's)",
    )
    parser.add_argument(
        "--teacher-prompts",
        action="store_true",
        help="the dense model continues the first tokens of the healing speeches' paragraphs (one prompt a paragraph "
        "of the pre-2000 speeches outside calibration's windows), not a bare start token",
    )
    parser.add_argument(
        "--sampling-start",
        choices=("bos", "chat", "random"),
        default="bos",
        help="RecoveryConfig.sampling_start: the BOS token, the chat template's assistant turn after a user turn "
        "holding the prompt (empty without one), or the BOS token and a first token drawn from the vocabulary",
    )
    parser.add_argument(
        "--teacher-text-loops",
        choices=("train", "mask"),
        default="train",
        help="RecoveryConfig.teacher_text_loops: train on every token of the dense model's text, or leave out of the "
        "loss each token that repeats a 4-gram earlier in its row",
    )
    parser.add_argument(
        "--sampling-temperature",
        type=float,
        default=1.0,
        help="RecoveryConfig.sampling_temperature: the temperature the dense model samples its rows at (default 1, "
        "its own distribution)",
    )
    parser.add_argument(
        "--guard-speeches",
        action="store_true",
        help="with --teacher-text 1.0: the gate's guard (RecoveryConfig.guard_text) is held-out rows of the healing "
        "speeches, never trained on; no state that makes them worse is kept",
    )
    parser.add_argument(
        "--optim", default=None, help="TrainingArguments.optim (e.g. adafactor); default: the Trainer's AdamW"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    return parser


def remove_training_checkpoints(folder: Path) -> list[Path]:
    """Deletes the healing phases' checkpoints (``phase-*``) under `folder`, once the result they led to is written:
    resuming a finished run has nothing left to do, and each phase keeps two checkpoints with the optimiser's state.
    What a rerun reads again stays: the untrained model's scores and the dense model's cached samples."""
    from optimum_flatten.recovery.resume import phase_folders

    removed = phase_folders(folder)
    for path in removed:
        shutil.rmtree(path)
    return removed


def main() -> None:
    from optimum_flatten import FlattenConfig, FlattenQuantizer, bundled
    from optimum_flatten.evaluation import tokenize_corpus
    from optimum_flatten.recovery import recover

    parser = build_parser()
    args = parser.parse_args()
    args.eval_tokens = args.eval_tokens or EVAL_TOKENS[args.model]
    if args.method not in VARIANTS or not VARIANTS[args.method].get("method"):
        raise SystemExit(f"--method must be a compression variant of benchmarks/depth/run.py, got {args.method!r}")
    if args.sweep_learning_rates and args.sweep_global_learning_rates:
        raise SystemExit("sweep one rate at a time: --sweep-learning-rates or --sweep-global-learning-rates")
    if (args.sweep_global_learning_rates or args.global_learning_rate) and not args.local_then_global_tokens:
        raise SystemExit("a global phase's rate needs a global phase: add --local-then-global-tokens")
    if args.checkpoint_dir and (args.sweep_learning_rates or args.sweep_global_learning_rates):
        raise SystemExit("--checkpoint-dir checkpoints one measured run, not a sweep of several")
    if args.calibration_seed and not args.own_text and args.calibration == "sotu":
        # The speeches' windows are always drawn with seed 0; the healing text would exclude seed N's instead and
        # train on the windows the compression calibrated on.
        raise SystemExit("--calibration-seed seeds the dense model's calibration rows: give it with --own-text or a "
                         "mixed --calibration")  # fmt: skip
    if not 0.0 <= args.teacher_text <= 1.0:
        raise SystemExit(f"--teacher-text is a share of the training rows, in [0, 1], got {args.teacher_text}")
    if args.teacher_text and not args.kd:
        raise SystemExit("--teacher-text samples the dense model's text and distils from it: add --kd")
    if args.guard_speeches and args.teacher_text < 1.0:
        raise SystemExit("--guard-speeches guards a healing on the dense model's own text: add --teacher-text 1.0")
    if (
        args.teacher_prompts
        or args.sampling_start != "bos"
        or args.sampling_temperature != 1.0
        or args.teacher_text_loops != "train"
    ) and not args.teacher_text:
        raise SystemExit(
            "--teacher-prompts, --sampling-start, --sampling-temperature and --teacher-text-loops shape the dense "
            "model's samples: add --teacher-text"
        )
    if args.mode == "local" and not args.kd:
        raise SystemExit("--mode local trains each span towards the dense model's states: add --kd")
    torch.set_num_threads(args.threads)

    dense, tokenizer = bundled.load_bundled(args.model)
    for parameter in dense.parameters():
        parameter.requires_grad_(False)
    model, _ = bundled.load_bundled(args.model)
    if args.sweep_learning_rates or args.sweep_global_learning_rates:
        sweep(args, dense, model, tokenizer)
        return
    streams = {
        "sotu_from_2000": tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000")),
        "bible_kjv": tokenize_corpus(tokenizer, bundled.load_corpus("bible:kjv")),
    }
    calibration = compression_calibration(args)
    options = {"num_layers_to_remove": DEPTHS[args.model], **calibration, **VARIANTS[args.method]}
    quantizer = FlattenQuantizer(FlattenConfig(**options), progress=False)
    start = time.perf_counter()
    quantizer.compress(model, tokenizer)
    compress_seconds = time.perf_counter() - start
    untrained = untrained_scores(args, lambda: measure(dense, model, streams, args.eval_tokens))

    texts, training_text = healing_text(args, tokenizer)
    # The healing speeches, read once for whichever of the prompts and the guard asks for them.
    wanted = args.teacher_prompts or args.guard_speeches
    speeches = (
        training_texts(tokenizer, args.calibration_texts, args.own_text, args.calibration_seed)[0] if wanted else None
    )
    args.prompt_texts = teacher_prompts(tokenizer, speeches) if args.teacher_prompts else None
    args.guard_texts = speeches if args.guard_speeches else None
    # None: the mode's default, scaled to the model's weights
    config = recovery_config(args, args.learning_rate, args.global_learning_rate)
    start = time.perf_counter()
    model, log = recover(model, tokenizer, texts, config, teacher=dense if args.kd else False, report=quantizer.report)
    heal_seconds = time.perf_counter() - start
    if any(step is not None for step in log.get("resumed_from_step", [])):
        # Resumed: this attempt's wall time misses the attempts before it; their training seconds are in the log.
        heal_seconds = log["train_seconds"]
    healed = measure(dense, model, streams, args.eval_tokens)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "model": args.model,
        "method": args.method,
        "method_options": VARIANTS[args.method],
        "plan": quantizer.report["plan_summary"],
        "mode": args.mode,
        "loss": "distillation" if args.kd else "lm",
        "max_tokens": args.max_tokens,
        # Where the checkpoints went and how often is not the protocol (a resumed run ends on the same weights);
        # the prompts' and the guard's texts are the speeches themselves, described in `training_text`.
        "settings": {k: v for k, v in vars(args).items() if k not in UNRECORDED_ARGUMENTS}
        | {"lr": log["learning_rate"]},
        "training_text": training_text,
        "teacher_text": log.get("teacher_text"),
        "eval_tokens": args.eval_tokens,
        "untrained": untrained,
        "healed": healed,
        "compress_seconds": compress_seconds,
        "heal_seconds": heal_seconds,
        "peak_rss_mb": peak_rss_mb,
        "threads": args.threads,
        "recovery": {k: v for k, v in log.items() if k not in ("loss_history", "heldout_history")},
        "heldout_history": log.get("heldout_history"),
        "loss_history": [(e["step"], e["loss"]) for e in log["loss_history"]],
    }
    kind = "kd" if args.kd else "lm"
    name = f"recovery_{args.model}_{args.method}_{args.mode}_{kind}_{args.max_tokens}{_variant(args)}.json"
    out = args.out or f"benchmarks/results/{name}"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("plan", "untrained", "healed", "heal_seconds", "peak_rss_mb")}, indent=2))
    print(f"gate: {log['gate']}; wrote {out}")
    if args.checkpoint_dir and not args.keep_checkpoints:
        remove_training_checkpoints(Path(args.checkpoint_dir))


def _variant(args: argparse.Namespace) -> str:
    """The file-name suffix of a run whose loss or schedule is not the default's (so it does not overwrite that run):
    its state loss, hidden-state terms, a distillation temperature or mix of its own, a global phase after
    `local`, warm-up, training rows of another length or number per step, a learning rate given by hand (the default
    follows the model's weights), and another healing seed."""
    suffix = "" if args.calibration == "sotu" else f"_cal{args.calibration}"
    suffix += f"_calseed{args.calibration_seed}" if args.calibration_seed else ""
    suffix += f"_own{args.own_text:g}" if getattr(args, "own_text", 0.0) else ""
    suffix += "" if args.state_loss == "pooled" else f"_{args.state_loss}"
    suffix += f"_hidden{args.hidden_weight:g}" if args.hidden_weight else ""
    suffix += f"_temperature{args.temperature:g}" if args.temperature != 1.0 else ""
    suffix += f"_alpha{args.kd_alpha:g}" if args.kd_alpha != 1.0 else ""
    suffix += f"_global{args.local_then_global_tokens}" if args.local_then_global_tokens else ""
    suffix += "_all" if args.local_then_global_tokens and args.global_scope == "all" else ""
    suffix += f"_warmup{args.warmup_ratio:g}" if args.warmup_ratio else ""
    suffix += f"_optim{args.optim}" if getattr(args, "optim", None) else ""
    suffix += f"_seq{args.seqlen}" if args.seqlen != DEFAULT_ROWS["seqlen"] else ""
    suffix += f"_batch{args.batch_size}" if args.batch_size != DEFAULT_ROWS["batch_size"] else ""
    suffix += f"_lr{args.learning_rate:g}" if args.learning_rate is not None and not args.sweep_learning_rates else ""
    suffix += "_frozen_embeddings" if args.freeze_embeddings else ""
    suffix += f"_seed{args.seed}" if args.seed != DEFAULT_SEED else ""
    suffix += f"_teacher{args.teacher_text}" if args.teacher_text else ""
    suffix += "_prompted" if getattr(args, "teacher_prompts", False) else ""
    start = getattr(args, "sampling_start", "bos")
    suffix += f"_{start}" if start != "bos" else ""
    sampling_temperature = getattr(args, "sampling_temperature", 1.0)
    suffix += f"_sampledat{sampling_temperature:g}" if sampling_temperature != 1.0 else ""
    suffix += "_guarded" if getattr(args, "guard_speeches", False) else ""
    suffix += "_loopsmasked" if getattr(args, "teacher_text_loops", "train") == "mask" else ""
    if args.sweep_global_learning_rates:
        return suffix + "_globalrates"
    return suffix + (f"_globallr{args.global_learning_rate:g}" if args.global_learning_rate is not None else "")


def healing_text(args: argparse.Namespace, tokenizer: object) -> tuple[Any, dict]:
    """The `recover` dataset and how the result describes it: the speeches outside calibration's windows, or with
    ``--teacher-text 1.0`` the dense model's own text only (no speech read unless ``--teacher-prompts`` takes the
    first tokens of its paragraphs as the samples' prompts)."""
    teacher = {"teacher_text": args.teacher_text, "prompts": _prompts_described(args)} if args.teacher_text else {}
    if args.teacher_text >= 1.0:
        return "teacher", {"corpus": "the dense model's own samples", **teacher}
    texts, excluded = training_texts(tokenizer, args.calibration_texts, args.own_text, args.calibration_seed)
    return texts, {"corpus": CALIBRATION["dataset"], "excluded": excluded, **teacher}


def _prompts_described(args: argparse.Namespace) -> str:
    if getattr(args, "teacher_prompts", False):
        return (
            f"the first {PROMPT_TOKENS} tokens of each paragraph of the pre-2000 speeches outside calibration's "
            "windows (one prompt a line, cycled in a seeded order)"
        )
    if getattr(args, "sampling_start", "bos") == "chat":
        return "none: the chat template's assistant turn, after an empty user turn"
    if getattr(args, "sampling_start", "bos") == "random":
        return "none: the BOS token, then a first token drawn uniformly from the ordinary vocabulary for each row"
    return "none (the BOS token)"


def teacher_prompts(tokenizer: object, texts: list[str]) -> list[str]:
    """The paragraphs of `texts` (the healing speeches, `training_texts`), each long enough to hold a prompt: what a
    user with a folder of their own documents gives as ``--prompts FILE`` (one document a line). They come from the
    same text as the healing rows, so no evaluation text ever becomes a prompt."""
    from optimum_flatten.evaluation import tokenize_corpus

    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    return [line for line in lines if tokenize_corpus(tokenizer, [line]).numel() >= PROMPT_TOKENS]


def recovery_config(args: argparse.Namespace, learning_rate: float | None, global_learning_rate: float | None = None):
    """The `RecoveryConfig` of the command line's options (the two rates given apart, for the sweeps)."""
    from optimum_flatten.recovery import RecoveryConfig

    return RecoveryConfig(
        mode=args.mode,
        local_then_global_tokens=args.local_then_global_tokens,
        global_scope=args.global_scope,
        global_learning_rate=global_learning_rate,
        last_k=args.last_k,
        train_embeddings=not args.freeze_embeddings,
        temperature=args.temperature,
        kd_alpha=args.kd_alpha,
        hidden_weight=args.hidden_weight,
        state_loss=args.state_loss,
        max_tokens=args.max_tokens,
        eval_every=args.eval_every,
        patience=args.patience,
        heldout_rows=args.heldout_rows,
        learning_rate=learning_rate,
        seqlen=args.seqlen,
        per_device_train_batch_size=args.batch_size,
        logging_steps=max(1, args.eval_every),
        seed=args.seed,
        extra_training_args=({"warmup_steps": args.warmup_ratio} if args.warmup_ratio else {})  # a float: a ratio
        | ({"optim": args.optim} if getattr(args, "optim", None) else {}),
        checkpoint_dir=getattr(args, "checkpoint_dir", None),
        save_every=args.save_every if getattr(args, "checkpoint_dir", None) else 0,
        teacher_text=args.teacher_text if args.teacher_text < 1.0 else 0.0,  # 1.0: the dataset says "teacher"
        teacher_text_cache=getattr(args, "teacher_text_cache", None),
        prompts=getattr(args, "prompt_texts", None),
        teacher_prompt_tokens=PROMPT_TOKENS,
        sampling_start=getattr(args, "sampling_start", "bos"),
        sampling_temperature=getattr(args, "sampling_temperature", 1.0),
        teacher_text_loops=getattr(args, "teacher_text_loops", "train"),
        guard_text=getattr(args, "guard_texts", None),
    )


def sweep(args: argparse.Namespace, dense: torch.nn.Module, model: torch.nn.Module, tokenizer: object) -> None:
    """Heals a copy of the compressed model at each rate (of both phases, or with --sweep-global-learning-rates of
    the global phase after the local one at its default); records the gate's held-out scores of the training text."""
    import copy

    from optimum_flatten import FlattenConfig, FlattenQuantizer
    from optimum_flatten.recovery import recover

    calibration = compression_calibration(args)
    options = {"num_layers_to_remove": DEPTHS[args.model], **calibration, **VARIANTS[args.method]}
    quantizer = FlattenQuantizer(FlattenConfig(**options), progress=False)
    quantizer.compress(model, tokenizer)
    texts, training_text = healing_text(args, tokenizer)
    runs = []
    of_global = bool(args.sweep_global_learning_rates)
    for rate in args.sweep_global_learning_rates or args.sweep_learning_rates:
        start = time.perf_counter()
        rates = (args.learning_rate, rate) if of_global else (rate, None)
        _, log = recover(
            copy.deepcopy(model),
            tokenizer,
            texts,
            recovery_config(args, *rates),
            teacher=dense if args.kd else False,
            report=quantizer.report,
        )
        runs.append(
            {
                "lr": rate,
                "heldout_before": log.get("heldout_before"),
                "heldout_after": log.get("heldout_after"),
                "best_step": log.get("best_step"),
                "steps": log["steps"],
                "gate": log["gate"],
                "local": log.get("local"),
                "heldout_history": log.get("heldout_history"),
                "global_phase": log.get("global_phase"),
                "heal_seconds": time.perf_counter() - start,
            }
        )
        print(json.dumps({k: runs[-1][k] for k in ("lr", "heldout_after", "best_step", "heal_seconds")}), flush=True)
    best = min(runs, key=lambda r: r["heldout_after"]["objective"])
    result = {
        "model": args.model,
        "method": args.method,
        "mode": args.mode,
        "loss": "distillation" if args.kd else "lm",
        "max_tokens": args.max_tokens,
        "plan": quantizer.report["plan_summary"],
        "selected_on": "the gate's held-out objective of the training text (held-out rows, never trained on)",
        "best_lr": best["lr"],
        "swept": "the global phase's rate" if of_global else "the learning rate",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "threads")},
        "training_text": training_text,
        "runs": runs,
    }
    kind = "kd" if args.kd else "lm"
    out = args.out or (
        f"benchmarks/results/lrsweep_{args.model}_{args.method}_{args.mode}_{kind}_{args.max_tokens}{_variant(args)}.json"
    )
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"best lr {best['lr']}; wrote {out}")


if __name__ == "__main__":
    main()
