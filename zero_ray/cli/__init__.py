"""The `zero-ray` command line. Each subcommand lives in its own module with a
`register(subparsers)` function that adds its parser and sets `func`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from zero_ray.cli.command_parser import CommandParser

# One module per subcommand (or family of subcommands); add new ones here.
_COMMAND_MODULES: tuple[str, ...] = (
    "zero_ray.cli.estimate",
    "zero_ray.cli.train",
    "zero_ray.cli.operator_commands",
    "zero_ray.cli.checkpoint",
    "zero_ray.cli.submit_command",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered subcommand."""
    parser = CommandParser(prog="zero-ray", description="ZeRO data parallelism on Ray")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zero-ray` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
