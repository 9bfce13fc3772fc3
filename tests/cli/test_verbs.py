"""Each verb's parser is its declaration (`cli.verbs`): one flag a field, with the field's default, type and help."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from optimum_flatten.cli.main import VERBS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("verb", VERBS, ids=lambda verb: verb.name)
def test_every_declared_field_is_an_argument_with_its_default_and_help(verb):
    actions = {action.dest: action for action in _subparsers()[verb.name]._actions}
    hints = typing.get_type_hints(verb.arguments)
    for field in dataclasses.fields(verb.arguments):
        action = actions[field.name]
        assert action.help == field.metadata["help"], field.name
        if field.metadata.get("positional"):
            assert action.option_strings == [], field.name
            continue
        assert action.option_strings == [f"--{field.name.replace('_', '-')}"], field.name
        assert action.default == field.default, field.name
        assert action.required == field.metadata.get("required", False), field.name
        if hints[field.name] is bool:
            assert isinstance(action, argparse._StoreTrueAction), field.name


def test_a_parsed_command_line_has_the_declared_types_and_defaults():
    parsers = _subparsers()
    args = parsers["evaluate"].parse_args(["m", "--stride", "3", "--no-speed", "--dtype", "bfloat16"])
    assert (args.model, args.stride, args.no_speed, args.dtype, args.seqlen) == ("m", 3, True, "bfloat16", 512)
    assert (args.baseline, args.device, args.speed_rounds) == (None, "cpu", 5)
    args = parsers["estimate"].parse_args(["m", "--num-layers-to-remove", "2", "--bandwidth-gbs", "3350"])
    assert (args.num_layers_to_remove, args.bandwidth_gbs, args.method) == (2, 3350.0, "flattengpt")
    with pytest.raises(SystemExit):  # --num-mlps and --mlp-fraction exclude each other
        parsers["layer-collapse"].parse_args(
            ["m", "--dataset", "d", "--output", "o", "--num-mlps", "2", "--mlp-fraction", "0.5"]
        )
    with pytest.raises(SystemExit):  # --output is required
        parsers["recover"].parse_args(["m"])
    assert parsers["recover"].parse_args(["m", "--output", "o"]).dataset == "teacher"


def test_the_verbs_that_train_or_calibrate_join_a_launchers_ranks():
    joining = {verb.name for verb in VERBS if verb.joins_launcher}
    assert joining == {"compress", "recover"}
    for name, parser in _subparsers().items():
        assert parser.get_default("joins_launcher") == (True if name in joining else None)
