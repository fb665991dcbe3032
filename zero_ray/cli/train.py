"""``zero-ray train``: the main job (a small GPT on the standard library's sources)."""

from __future__ import annotations

import argparse
from typing import Any

from zero_ray.cli.command_parser import CommandParser


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train a small GPT on a local Ray (the main job)",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    # zero_ray.demo imports torch: only `zero-ray train` itself pays for it, not --help or status.
    if isinstance(parser, CommandParser):
        parser.defer(_main_job_arguments)
    else:
        _main_job_arguments(parser)


def _main_job_arguments(parser: argparse.ArgumentParser) -> None:
    from zero_ray import demo

    parser.description = demo.__doc__
    demo.add_arguments(parser)
    parser.set_defaults(func=demo.run)
