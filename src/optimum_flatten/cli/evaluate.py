"""`optimum-flatten evaluate`: perplexity, fidelity, generation and speed of a checkpoint, against a baseline."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from .evaluate_checks import check_arguments, check_models, check_text, check_tokenizers, check_vocabularies
from .sources import checkpoint_path
from .summary import text_table

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """What `evaluate` measured: one entry per model (the baseline first), and which comparisons ran."""

    entries: list[dict[str, Any]]
    #: Bits per byte on a common text, when the tokenizers differ (`_per_byte_comparison`); else None.
    per_byte: dict[str, Any] | None
    #: Prefill and decode timed alternately against the baseline; None without one or with --no-speed.
    speed: dict[str, Any] | None
    #: Whether KL / top-1 agreement and greedy agreement were measured (same tokens, not switched off).
    compare: bool
    generative: bool
    #: Where the models ran (``--device auto`` resolved) and in which dtype: in the protocol and the JSON, since a
    #: perplexity in float16 on a GPU is not the float32 one on the CPU.
    device: str = "cpu"
    dtype: str = "float32"


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Perplexity and speed of a checkpoint; with a baseline, side by side and with KL and top-1 agreement to it."""
    check_arguments(args)  # before the measurements, which a bad option or path would otherwise lose
    evaluation = measure(args)
    print(text_table(*_table(evaluation, args)))
    for line in _protocol_lines(evaluation, args):
        print(line)
    _write_outputs(evaluation, args)
    return 0


def measure(args: argparse.Namespace) -> Evaluation:
    """Every measurement the command line asks for: perplexity of each model, then, against a baseline, the
    interleaved speed and the agreement measures (KL, top-1, greedy) on the baseline's tokens."""
    import torch

    from ..calibration.data import load_texts
    from ..evaluation.compare import Checkpoints
    from ..utils.torch_utils import resolve_device

    device = resolve_device(args.device)
    names = ([args.baseline] if args.baseline else []) + [args.model]
    # Bundled names become their converted folders; a missing folder or a corrupt config is refused here, in one
    # line, before either model loads, as is everything else the configs, the tokenizers and the text can say.
    paths = [checkpoint_path(name) for name in names]
    configs = check_models(paths, args)
    texts = load_texts(args.dataset, args.text_column)  # read once; every measurement scores these texts
    # Every checkpoint is loaded once, in the same dtype, on the same device, with the same code, and shared by the
    # measurements below. Held across them only where a comparison will hold both models at once anyway (the
    # interleaved speed, KL and top-1, greedy agreement); perplexities alone load one model at a time.
    pairwise = bool(args.baseline) and not (args.no_speed and args.no_fidelity and args.no_generation)
    checkpoints = Checkpoints(getattr(torch, args.dtype), device, args.trust_remote_code, keep_models=pairwise)
    tokenizers = check_tokenizers(paths, configs, texts, checkpoints)
    per_byte = _per_byte_comparison(tokenizers[0], tokenizers[-1], texts, args) if args.baseline else None
    same_tokens = bool(args.baseline) and per_byte is None
    compare, generative = same_tokens and not args.no_fidelity, same_tokens and not args.no_generation
    if compare or generative:
        check_vocabularies(paths, configs)
    check_text(paths[0], texts, args, generative)
    entries = _perplexities(paths, names, texts, per_byte, checkpoints, args)
    speed = _interleaved_speed(paths, entries, checkpoints, args) if args.baseline and not args.no_speed else None
    # KL, top-1 and greedy agreement compare the models position by position on the baseline's tokens: meaningless
    # when the tokens differ. Both are run alike, on the baseline's and the model's checkpoints and the texts.
    _agreements(paths, entries[-1], texts, compare, generative, checkpoints, args)
    return Evaluation(entries, per_byte, speed, compare, generative, str(device), args.dtype)


def _perplexities(
    paths: list[str],
    names: list[str],
    texts: list[str],
    per_byte: dict[str, Any] | None,
    checkpoints: Any,
    args: Any,
) -> list[dict[str, Any]]:
    """Each model's perplexity (and its own timing without a baseline, and lm-eval tasks); with tokenizers that
    differ, on the common text, with bits per byte."""
    import math

    from ..evaluation.compare import evaluate_checkpoint
    from ..evaluation.tokenization import bits_per_byte

    dataset, max_tokens = texts, args.max_tokens
    if per_byte is not None:
        # Both models score the same text (the one the baseline's token budget covers), each in its own tokens.
        dataset, max_tokens = per_byte["texts"], None
    entries = [
        evaluate_checkpoint(
            p,
            dataset,
            seqlen=args.seqlen,
            stride=args.stride,
            max_tokens=max_tokens,
            speed=not args.no_speed and not args.baseline,  # against a baseline: interleaved, below
            lm_eval_tasks=[t for t in (args.lm_eval_tasks or "").split(",") if t],
            lm_eval_limit=args.lm_eval_limit,
            speed_repeats=args.speed_rounds,
            checkpoints=checkpoints,
        )
        for p in paths
    ]
    for entry, name in zip(entries, names, strict=True):
        entry["path"] = name
        if per_byte is not None:
            entry["bits_per_byte"] = bits_per_byte(math.log(entry["perplexity"]), per_byte["tokens"][name], dataset)
    return entries


def _interleaved_speed(paths: list[str], entries: list[dict[str, Any]], checkpoints: Any, args: Any) -> dict[str, Any]:
    """Prefill and decode of the baseline and the model timed in alternating rounds, each side in its entry."""
    from ..evaluation.compare import speed_against_baseline

    speed = speed_against_baseline(
        paths[0], paths[-1], seqlen=args.seqlen, rounds=args.speed_rounds, checkpoints=checkpoints
    )
    for kind, comparison in speed.items():
        entries[0][kind], entries[-1][kind] = comparison.side("baseline"), comparison.side("candidate")
        entries[-1][f"{kind}_comparison"] = comparison.to_dict()
    return speed


def _agreements(
    paths: list[str],
    entry: dict[str, Any],
    texts: list[str],
    compare: bool,
    generative: bool,
    checkpoints: Any,
    args: Any,
) -> None:
    """KL and top-1 agreement on the perplexity's windows, and greedy agreement, into the model's `entry`."""
    from ..evaluation.compare import fidelity_to_baseline, generation_against_baseline

    window = {"seqlen": args.seqlen, "stride": args.stride, "max_tokens": args.max_tokens}
    for key, wanted, against, options in (
        ("fidelity", compare, fidelity_to_baseline, window),
        ("generation", generative, generation_against_baseline, {}),
    ):
        if wanted:
            entry[key] = against(paths[0], paths[-1], texts, **options, checkpoints=checkpoints)


def _table(evaluation: Evaluation, args: Any) -> tuple[list[list[Any]], list[str]]:
    """(rows, header) of the printed table: one row a model, a column a measurement that ran."""
    entries, per_byte, speed = evaluation.entries, evaluation.per_byte, evaluation.speed
    base = entries[0]
    rows = []
    for entry in entries:
        row = [entry["path"], entry["layers"], f"{entry['perplexity']:.3f}"]
        if per_byte is None:
            row.append(f"{entry['perplexity'] / base['perplexity']:.3f}")
        else:
            row += [f"{entry['bits_per_byte']:.4f}", f"{entry['bits_per_byte'] / base['bits_per_byte']:.3f}"]
        if evaluation.compare:
            measured = entry.get("fidelity")
            row += [f"{measured['kl']:.4f}", f"{measured['top1_agreement']:.4f}"] if measured else ["-", "-"]
        if evaluation.generative:
            measured = entry.get("generation")
            row += [f"{measured['token_agreement']:.3f}"] if measured else ["-"]
        if not args.no_speed:
            row += [f"{entry[k]['tokens_per_second']:.1f} ({entry[k]['spread']:.1%})" for k in ("prefill", "decode")]
        if speed:
            is_base = entry is base
            row += ["1.000" if is_base else speed[k].verdict.cell() for k in ("prefill", "decode")]
        rows.append(row)
    header = ["model", "layers", "perplexity"] + (
        ["ppl ratio"] if per_byte is None else ["bits/byte", "bits/byte ratio"]
    )
    header += ["KL vs baseline", "top-1 agreement"] if evaluation.compare else []
    header += ["greedy agreement"] if evaluation.generative else []
    header += [] if args.no_speed else ["prefill tok/s (IQR)", "decode tok/s (IQR)"]
    header += ["prefill ratio", "decode ratio"] if speed else []
    return rows, header


def _protocol_lines(evaluation: Evaluation, args: Any) -> list[str]:
    """The lines under the table saying how each measurement was taken (and the lm-eval scores)."""
    from ..evaluation.speed import describe_environment

    entries, per_byte, speed = evaluation.entries, evaluation.per_byte, evaluation.speed
    base = entries[0]
    lines = [f"every model loaded in {evaluation.dtype} on {evaluation.device}"]
    if per_byte is None:
        lines.append(f"perplexity: {args.dataset}, {base['protocol']}")
    else:
        covered = per_byte["tokens"][base["path"]]
        cover = (
            f"the whole text, {covered} of the baseline's tokens"
            if args.max_tokens is None or covered < args.max_tokens
            else f"the text the baseline's first {args.max_tokens} tokens cover"
        )
        lines.append(
            f"bits per byte: both models on the same {per_byte['bytes']} UTF-8 bytes of {args.dataset} ({cover}), "
            f"each in its own tokens; the tokenizers differ ({per_byte['difference']}), so perplexities are per "
            "different tokens and are not compared, and KL, top-1 and greedy agreement are not measured"
        )
        lines += [f"perplexity [{entry['path']}]: {entry['protocol']}" for entry in entries]
    if evaluation.compare:
        lines.append(
            "fidelity: mean per-token KL(baseline ‖ model) in nats and share of tokens whose most likely next token "
            "is the baseline's, on the same windows and tokens as the perplexity"
        )
    if evaluation.generative:
        measured = entries[-1]["generation"]
        lines.append(
            f"greedy agreement: share of generated tokens equal to the baseline's ({measured['protocol']}); "
            f"agreeing prefix {measured['mean_agreeing_prefix']:.1f} of {measured['new_tokens']} tokens on average, "
            f"{measured['exact']:.0%} of continuations identical"
        )
    for entry in entries:
        for task, metrics in (entry.get("lm_eval") or {}).items():
            shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
            lines.append(f"lm-eval {task} [{entry['path']}]: {shown}")
    if speed:
        lines += [comparison.describe() for comparison in speed.values()]
        lines.append(
            "speed: baseline and model timed alternately, synchronised; tok/s are medians with the interquartile "
            "range over the median in brackets; a ratio is the median of the per-round ratios, 'noisy, not reported' "
            "when their spread is wider than the effect, '(!)' when beyond L/L' x (1 + spread)"
        )
    elif not args.no_speed:
        p, d = base["prefill"], base["decode"]
        lines.append(
            f"speed on {describe_environment(p)}: prefill batch {p['batch_size']} x {p['seqlen']} tokens, no cache; "
            f"decode batch {d['batch_size']}, prompt {d['prompt_length']}, {d['new_tokens']} generated tokens, "
            f"KV cache; medians of {p['repeats']} synchronised runs after 1 warm-up, interquartile range over the "
            "median in brackets"
        )
    return lines


def _write_outputs(evaluation: Evaluation, args: Any) -> None:
    """The measurements as JSON (--json), without the reports they carry, then the figure (--plot): the numbers
    first, so that a figure that fails loses nothing measured. Each file is written whole or not at all."""
    import json

    from ..evaluation.compare import plot_comparison
    from ..utils.files import write_atomically

    if args.json:
        slim = [{k: v for k, v in e.items() if k != "flatten_report"} for e in evaluation.entries]
        measured: dict[str, Any] = {
            "dataset": str(args.dataset),
            "device": evaluation.device,
            "dtype": evaluation.dtype,
            "models": slim,
        }
        if evaluation.per_byte is not None:
            measured["comparison"] = {"measure": "bits_per_byte", "bytes": evaluation.per_byte["bytes"]}
            measured["tokenizers_differ"] = evaluation.per_byte["difference"]
        text = json.dumps(measured, indent=2)
        write_atomically(args.json, lambda temporary: temporary.write_text(text, encoding="utf-8"))
        print(f"json: {args.json}")
    if args.plot:
        print(f"plot: {plot_comparison(evaluation.entries, args.plot)}")


def _per_byte_comparison(
    baseline: Any, model: Any, texts: list[str], args: argparse.Namespace
) -> dict[str, Any] | None:
    """None when the baseline's and the model's tokenizers encode the evaluation text alike; else, with
    --allow-different-tokenizers, the common text and each model's token count on it, for bits per byte (refused
    without the flag)."""
    from ..evaluation.perplexity import tokenize_corpus
    from ..evaluation.tokenization import first_difference, text_budget

    tokenizers = [baseline, model]
    difference = first_difference(tokenizers[0], tokenizers[1], texts, args.max_tokens)
    if difference is None:
        return None
    if not args.allow_different_tokenizers:
        raise ValueError(
            f"the baseline {args.baseline!r} and {args.model!r} tokenise the evaluation text differently "
            f"({difference.describe()}), so a perplexity ratio, KL or top-1 agreement would compare different tokens; "
            "compare with the dense model the checkpoint was compressed from, or pass --allow-different-tokenizers "
            "to compare bits per byte on the same text instead."
        )
    common = text_budget(tokenizers[0], texts, args.max_tokens)
    return {
        "texts": common,
        "bytes": sum(len(text.encode("utf-8")) for text in common),
        "tokens": {
            name: int(tokenize_corpus(tokenizer, common).numel())
            for name, tokenizer in zip((args.baseline, args.model), tokenizers, strict=True)
        },
        "difference": difference.describe(),
    }
