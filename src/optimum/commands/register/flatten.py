"""Registers `optimum-cli flatten <verb> ...` (optimum's PEP 420 namespace: this folder holds no __init__.py).

optimum imports every registration module when its CLI starts, so this one imports nothing but argparse and
optimum's command base: not torch, not transformers, not optimum_flatten. The arguments after ``flatten`` are handed
to `optimum_flatten.cli.main.main` when the command runs, so both entry points share one parser.
"""

from __future__ import annotations

import argparse

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


class FlattenOptimumCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="flatten", help="depth compression: compress | evaluate | recover | demo")

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "flatten_argv", nargs=argparse.REMAINDER, help="a verb and its options, as for `optimum-flatten`"
        )

    def run(self) -> None:
        from optimum_flatten.cli.main import main

        code = main(self.args.flatten_argv or ["--help"])
        if code:
            raise SystemExit(code)


REGISTER_COMMANDS = [FlattenOptimumCommand]
