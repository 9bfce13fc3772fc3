"""Registers `optimum-cli flatten <verb> ...` (optimum's PEP 420 namespace: this folder holds no __init__.py).

optimum imports every registration module when its CLI starts, so this one imports nothing but argparse and
optimum's command base: not torch, not transformers, not optimum_flatten. The arguments after ``flatten`` are handed
to `optimum_flatten.cli.main.main` when the command runs, so both entry points share one parser.
"""

from __future__ import annotations

import argparse

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

#: What optimum's CLI names this command (its parser's prog, read at run time; this is the fallback).
PROG = "optimum-cli flatten"


class FlattenOptimumCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name="flatten", help="depth compression: compress | evaluate | recover | estimate | layer-collapse | demo"
    )

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        # optimum builds this parser with its own -h, and argparse reads a flag before the first positional as the
        # parser's own: `-v` before the verb is declared here and handed on, and the help optimum's -h prints names
        # the verbs and where each one's options are.
        parser.description = (
            "optimum-flatten's verbs: compress, evaluate, recover, estimate, layer-collapse, demo. "
            "`optimum-cli flatten VERB --help` lists a verb's options."
        )
        parser.add_argument("-v", "--verbose", dest="flatten_verbose", action="store_true", help="log at INFO level")
        parser.add_argument(
            "flatten_argv", nargs=argparse.REMAINDER, help="a verb and its options, as for `optimum-flatten`"
        )

    def run(self) -> None:
        """Hands the arguments to `optimum_flatten.cli.main.main` under optimum's name for the command.

        No arguments are handed on as none: the shared parser prints the usage line and refuses a missing verb
        with exit 2, as a bare ``optimum-flatten`` does (they used to become ``--help``, which exits 0, so a script
        that forgot its verb passed). `prog` is the parser's own, ``optimum-cli flatten``, so that every usage line
        and refusal names the command the user typed."""
        from optimum_flatten.cli.main import main

        argv = list(self.args.flatten_argv)
        code = main(["-v", *argv] if self.args.flatten_verbose else argv, prog=self.parser.prog or PROG)
        if code:
            raise SystemExit(code)


REGISTER_COMMANDS = [FlattenOptimumCommand]
