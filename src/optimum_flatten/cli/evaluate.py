"""`optimum-flatten evaluate`: perplexity, fidelity, generation and speed of a checkpoint, against a baseline."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .sources import checkpoint_path
from .summary import text_table

logger = logging.getLogger(__name__)


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Perplexity and speed of a checkpoint; with a baseline, side by side and with KL and top-1 agreement to it."""
    import json
    import math

    import torch

    from ..evaluation.compare import (
        evaluate_checkpoint,
        fidelity_to_baseline,
        generation_against_baseline,
        plot_comparison,
        speed_against_baseline,
    )
    from ..evaluation.speed import describe_environment
    from ..evaluation.tokenization import bits_per_byte
    from ..utils.torch_utils import resolve_device

    device = resolve_device(args.device)
    if args.speed_rounds < 1:
        raise ValueError(f"--speed-rounds must be at least 1, got {args.speed_rounds}")
    names = ([args.baseline] if args.baseline else []) + [args.model]
    # Bundled names become their converted folders; a missing folder or a corrupt config is refused here, in one
    # line, before either model loads.
    paths = [checkpoint_path(name) for name in names]
    for path in paths:
        _check_positions(path, args.seqlen, args.trust_remote_code)
    dataset, max_tokens, per_byte = args.dataset, args.max_tokens, None
    if args.baseline:
        per_byte = _per_byte_comparison(paths[0], paths[-1], args)
        if per_byte is not None:
            # Both models score the same text (the one the baseline's token budget covers), each in its own tokens.
            dataset, max_tokens = per_byte["texts"], None
    # How every checkpoint is loaded, by each evaluation below: the same dtype, device and code for all of them.
    loading: dict[str, Any] = {
        "dtype": getattr(torch, args.dtype),
        "trust_remote_code": args.trust_remote_code,
        "device": device,
    }
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
            **loading,
        )
        for p in paths
    ]
    for entry, name in zip(entries, names, strict=True):
        entry["path"] = name
        if per_byte is not None:
            entry["bits_per_byte"] = bits_per_byte(math.log(entry["perplexity"]), per_byte["tokens"][name], dataset)
    base = entries[0]
    speed = None
    if args.baseline and not args.no_speed:
        speed = speed_against_baseline(
            paths[0],
            paths[-1],
            seqlen=args.seqlen,
            rounds=args.speed_rounds,
            **loading,
        )
        for kind, comparison in speed.items():
            base[kind], entries[-1][kind] = comparison.side("baseline"), comparison.side("candidate")
            entries[-1][f"{kind}_comparison"] = comparison.to_dict()
    # KL, top-1 and greedy agreement compare the models position by position on the baseline's tokens: meaningless
    # when the tokens differ. Both are run alike, on the baseline's and the model's checkpoints and the dataset.
    same_tokens = bool(args.baseline) and per_byte is None
    compare, generative = same_tokens and not args.no_fidelity, same_tokens and not args.no_generation
    window = {"seqlen": args.seqlen, "stride": args.stride, "max_tokens": args.max_tokens}
    for key, wanted, against, options in (
        ("fidelity", compare, fidelity_to_baseline, window),
        ("generation", generative, generation_against_baseline, {}),
    ):
        if wanted:
            entries[-1][key] = against(paths[0], paths[-1], args.dataset, **options, **loading)
    rows = []
    for entry in entries:
        row = [entry["path"], entry["layers"], f"{entry['perplexity']:.3f}"]
        if per_byte is None:
            row.append(f"{entry['perplexity'] / base['perplexity']:.3f}")
        else:
            row += [f"{entry['bits_per_byte']:.4f}", f"{entry['bits_per_byte'] / base['bits_per_byte']:.3f}"]
        if compare:
            measured = entry.get("fidelity")
            row += [f"{measured['kl']:.4f}", f"{measured['top1_agreement']:.4f}"] if measured else ["-", "-"]
        if generative:
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
    header += ["KL vs baseline", "top-1 agreement"] if compare else []
    header += ["greedy agreement"] if generative else []
    header += [] if args.no_speed else ["prefill tok/s (IQR)", "decode tok/s (IQR)"]
    header += ["prefill ratio", "decode ratio"] if speed else []
    print(text_table(rows, header))
    if per_byte is None:
        print(f"perplexity: {args.dataset}, {base['protocol']}")
    else:
        print(
            f"bits per byte: both models on the same {per_byte['bytes']} UTF-8 bytes of {args.dataset} (the text the "
            f"baseline's first {args.max_tokens} tokens cover), each in its own tokens; the tokenizers differ "
            f"({per_byte['difference']}), so perplexities are per different tokens and are not compared, and KL and "
            "top-1 agreement are not measured"
        )
        for entry in entries:
            print(f"perplexity [{entry['path']}]: {entry['protocol']}")
    if compare:
        print(
            "fidelity: mean per-token KL(baseline ‖ model) in nats and share of tokens whose most likely next token "
            "is the baseline's, on the same windows and tokens as the perplexity"
        )
    if generative:
        measured = entries[-1]["generation"]
        print(
            f"greedy agreement: share of generated tokens equal to the baseline's ({measured['protocol']}); "
            f"agreeing prefix {measured['mean_agreeing_prefix']:.1f} of {measured['new_tokens']} tokens on average, "
            f"{measured['exact']:.0%} of continuations identical"
        )
    for entry in entries:
        for task, metrics in (entry.get("lm_eval") or {}).items():
            shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
            print(f"lm-eval {task} [{entry['path']}]: {shown}")
    if speed:
        for comparison in speed.values():
            print(comparison.describe())
        print(
            "speed: baseline and model timed alternately, synchronised; tok/s are medians with the interquartile "
            "range over the median in brackets; a ratio is the median of the per-round ratios, 'noisy, not reported' "
            "when their spread is wider than the effect, '(!)' when beyond L/L' x (1 + spread)"
        )
    elif not args.no_speed:
        p, d = base["prefill"], base["decode"]
        print(
            f"speed on {describe_environment(p)}: prefill batch {p['batch_size']} x {p['seqlen']} tokens, no cache; "
            f"decode batch {d['batch_size']}, prompt {d['prompt_length']}, {d['new_tokens']} generated tokens, "
            f"KV cache; medians of {p['repeats']} synchronised runs after 1 warm-up, interquartile range over the "
            "median in brackets"
        )
    if args.plot:
        print(f"plot: {plot_comparison(entries, args.plot)}")
    if args.json:
        slim = [{k: v for k, v in e.items() if k != "flatten_report"} for e in entries]
        measured = {"dataset": str(args.dataset), "models": slim}
        if per_byte is not None:
            measured["comparison"] = {"measure": "bits_per_byte", "bytes": per_byte["bytes"]}
            measured["tokenizers_differ"] = per_byte["difference"]
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(measured, handle, indent=2)
    return 0


def _check_positions(path: str, seqlen: int, trust_remote_code: bool) -> None:
    """Refuses a --seqlen past a position table (warns past RoPE's trained length) from the config alone."""
    from transformers import AutoConfig

    from ..utils.positions import check_sequence_length

    check_sequence_length(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), seqlen, "--seqlen")


def _per_byte_comparison(baseline: str, model: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """None when both tokenizers encode the evaluation text alike; else, with --allow-different-tokenizers, the
    common text and each model's token count on it, for bits per byte (refused without the flag)."""
    from transformers import AutoTokenizer

    from ..calibration.data import load_texts
    from ..evaluation.perplexity import tokenize_corpus
    from ..evaluation.tokenization import first_difference, text_budget

    remote = args.trust_remote_code
    tokenizers = [AutoTokenizer.from_pretrained(p, trust_remote_code=remote) for p in (baseline, model)]
    texts = load_texts(args.dataset)
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
