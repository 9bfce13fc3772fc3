"""What `optimum-flatten evaluate` refuses before any model loads, each in one line.

Every measurement loads one or two models and runs for minutes; a refusal that the arguments, the configs or the
tokenizer could have given earlier would lose that work (and the --json the user asked for). So everything knowable
without the weights is checked here first: the options, the output files, that both checkpoints are causal LMs with
positions for every sequence the measurements run, that the models compared position by position share a vocabulary,
that the text holds the greedy prompts, and that lm-eval and its tasks exist.
"""

from __future__ import annotations

import argparse
import inspect
import os
from pathlib import Path
from typing import Any

#: Rounds a speed needs for a spread: with one, the interquartile range is not defined, and a ratio of two single
#: timings would be printed as a measured speed-up.
MIN_SPEED_ROUNDS = 2


def check_arguments(args: argparse.Namespace) -> None:
    """The options alone: the budgets, the output files (and the figure's format) and lm-eval's tasks; and one
    process (under a launcher every rank measured the whole evaluation and timed on the same cores or GPU)."""
    from ..utils.launch import launched_world_size

    if launched_world_size() > 1:
        raise ValueError(
            "evaluate measures in one process; run it without torchrun or a launcher (its timings would share the "
            "device with the other ranks, and every rank would write the same outputs)."
        )
    if args.speed_rounds < 1 or (args.speed_rounds < MIN_SPEED_ROUNDS and not args.no_speed):
        raise ValueError(
            f"--speed-rounds must be at least {MIN_SPEED_ROUNDS} (a median needs a spread to be trusted), got "
            f"{args.speed_rounds}; or pass --no-speed."
        )
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2 (a token is scored after one), got {args.max_tokens}")
    if args.seqlen < 2:
        raise ValueError(f"--seqlen must be at least 2 (a window scores each token after its first), got {args.seqlen}")
    if args.stride is not None and not 1 <= args.stride <= args.seqlen:
        raise ValueError(f"--stride must be in 1..--seqlen ({args.seqlen}), got {args.stride}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        check_output_file(path, option)
    check_outputs_apart(args)
    if args.plot:
        check_figure_format(args.plot)
    _check_companions(args)
    tasks = [t for t in (args.lm_eval_tasks or "").split(",") if t]
    if tasks:
        from ..evaluation.harness import check_tasks

        check_tasks(tasks, args.lm_eval_limit)


def _check_companions(args: argparse.Namespace) -> None:
    """Refuses an option that only means something beside another one that was not given, which would otherwise be
    accepted and do nothing."""
    companions = (
        ("--lm-eval-limit", args.lm_eval_limit is not None, "--lm-eval-tasks", bool(args.lm_eval_tasks)),
        ("--allow-different-tokenizers", args.allow_different_tokenizers, "--baseline", bool(args.baseline)),
    )
    for option, given, needed, present in companions:
        if given and not present:
            raise ValueError(f"{option} applies with {needed}, which was not given; give both or neither.")


def check_output_file(path: str | None, option: str) -> None:
    """Refuses a file path `option` cannot write (a folder, a parent folder that does not exist or is not writable),
    in one line, before any model loads."""
    if path is None:
        return
    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ValueError(f"{option} {path!r} is a folder; give a file path.")
    if not parent.is_dir():
        raise ValueError(f"{option} {path!r}: its folder {str(parent)!r} does not exist; create it or give another.")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path!r} is not writable; give another path.")


def check_outputs_apart(args: argparse.Namespace) -> None:
    """Refuses a --json or --plot that would be written over what the evaluation reads (a file of the checkpoint or
    the baseline, the text) or over the other output: the write replaces whatever is there, and a config.json
    written over with measurements leaves a checkpoint that no longer loads."""
    outputs = {
        option: Path(path).expanduser().resolve()
        for option, path in (("--json", args.json), ("--plot", args.plot))
        if path
    }
    if len(outputs) == 2 and outputs["--json"] == outputs["--plot"]:
        raise ValueError(f"--json and --plot are the same file {args.json!r}; give each its own path.")
    inputs = {"the checkpoint": args.model, "--baseline": args.baseline, "--dataset": args.dataset}
    for option, target in outputs.items():
        for what, given in inputs.items():
            source = Path(given).expanduser() if given else None
            if source is None or not source.exists():
                continue  # a Hub name, a bundled model or corpus: nothing of the user's on disk to write over
            source = source.resolve()
            if target == source or (source.is_dir() and source in target.parents):
                raise ValueError(
                    f"{option} {str(target)!r} would be written over {what} {given!r}, which the evaluation reads; "
                    "give a path outside it."
                )


def check_figure_format(path: str) -> None:
    """Refuses a --plot whose suffix matplotlib cannot write (``fig.txt``), which it would refuse only at the end."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        written = ", ".join(sorted(formats))
        raise ValueError(f"--plot {path!r}: matplotlib writes {written}, not {suffix or 'a file without a suffix'!r}.")


def check_models(paths: list[str], args: argparse.Namespace) -> list[Any]:
    """From the configs: each checkpoint is a causal LM with positions for every sequence run; returns the configs
    (for `check_vocabularies`)."""
    from transformers import AutoConfig

    from ..utils.causal_lm import non_causal_description
    from ..utils.positions import check_sequence_length

    configs = [AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code) for path in paths]
    for path, config in zip(paths, configs, strict=True):
        what = non_causal_description(config)
        if what is not None:
            raise ValueError(
                f"evaluate scores causal language models (each token from those before it), and {path} is {what}: "
                "loaded as a causal LM its perplexity would mean nothing."
            )
        check_sequence_length(config, args.seqlen, "--seqlen")
        _check_fixed_lengths(path, config, args)
    return configs


def check_vocabularies(paths: list[str], configs: list[Any]) -> None:
    """The two models compared token by token (KL, top-1, greedy agreement: asked only where their tokenizers encode
    the text alike) predict over the same vocabulary, read from their configs."""
    sizes = [config.get_text_config().vocab_size for config in configs]
    if sizes[0] != sizes[-1]:
        raise ValueError(
            f"the baseline predicts over {sizes[0]} tokens and {paths[-1]} over {sizes[-1]}, so KL, top-1 and "
            "greedy agreement cannot compare them position by position; pass --no-fidelity --no-generation."
        )


def check_tokenizers(paths: list[str], configs: list[Any], texts: list[str], checkpoints: Any) -> list[Any]:
    """Each checkpoint has a tokenizer that loads, and every id it gives the evaluation text is a row of its model's
    embedding: another model's tokenizer saved beside the weights fails deep inside the first forward otherwise
    (an IndexError on CPU, a device-side assert on CUDA), after the weights have loaded. Returns the tokenizers,
    which the comparison of two of them reads (`evaluate._per_byte_comparison`); they and the token streams stay in
    `checkpoints` (`evaluation.compare.Checkpoints`) for the measurements."""
    tokenizers = []
    for path, config in zip(paths, configs, strict=True):
        try:
            tokenizer = checkpoints.tokenizer(path)
        except Exception as error:  # transformers raises many kinds, over several lines
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ValueError(
                f"{path} has no tokenizer that loads ({first}); save the model's tokenizer beside it "
                "(tokenizer.save_pretrained)."
            ) from error
        stream = checkpoints.tokens(path, texts)
        vocabulary = config.get_text_config().vocab_size
        if stream.numel() and int(stream.max()) >= vocabulary:
            raise ValueError(
                f"the tokenizer of {path} gives the evaluation text the id {int(stream.max())}, and its model has "
                f"{vocabulary} token embeddings (config.vocab_size): the tokenizer is not this model's."
            )
        tokenizers.append(tokenizer)
    return tokenizers


def _check_fixed_lengths(path: str, config: Any, args: argparse.Namespace) -> None:
    """Refuses a learned position table shorter than the decode timing's or the greedy agreement's sequences, which
    run fixed prompts and new tokens whatever --seqlen says."""
    from ..evaluation.compare import generation_against_baseline
    from ..evaluation.speed import decode_tokens_per_second
    from ..utils.positions import position_limit

    runs = []
    if not args.no_speed:
        runs.append(("the decode timing", decode_tokens_per_second, "--no-speed"))
    if args.baseline and not args.no_generation:
        runs.append(("the greedy agreement", generation_against_baseline, "--no-generation"))
    limit = position_limit(config)
    for what, measure, switch in runs:
        prompt, new = _defaults(measure, "prompt_length", "new_tokens")
        if limit is not None and limit[2] and prompt + new > limit[0]:
            raise ValueError(
                f"{what} runs {prompt}-token prompts and {new} new tokens ({prompt + new} positions), past the "
                f"{limit[0]} positions of {path} (config.{limit[1]}); pass {switch}."
            )


def _defaults(measure: Any, *names: str) -> tuple[int, ...]:
    """The lengths a measurement runs by default (prompts, prompt tokens, new tokens): read from its signature,
    their one source."""
    parameters = inspect.signature(measure).parameters
    return tuple(int(parameters[name].default) for name in names)


def check_text(baseline: str, texts: list[str], args: argparse.Namespace, generative: bool) -> None:
    """Refuses a text too short for the greedy agreement's prompts, tokenised as that measurement will tokenise it."""
    if not generative:
        return
    from transformers import AutoTokenizer

    from ..evaluation.compare import generation_against_baseline
    from ..evaluation.perplexity import tokenize_corpus

    prompts, prompt_length = _defaults(generation_against_baseline, "prompts", "prompt_length")
    tokenizer = AutoTokenizer.from_pretrained(baseline, trust_remote_code=args.trust_remote_code)
    tokens = 0
    for text in texts:  # the stream's tokens, text by text (EOS after each), only until the prompts are covered
        tokens += int(tokenize_corpus(tokenizer, [text]).numel())
        if tokens >= prompts * prompt_length:
            return
    raise ValueError(
        f"the evaluation text has {tokens} tokens, fewer than the greedy agreement's {prompts} prompts of "
        f"{prompt_length} need; give a longer text or pass --no-generation."
    )
