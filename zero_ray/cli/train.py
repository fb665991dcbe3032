"""``zero-ray train``: the main job (a small GPT on the standard library's sources)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from zero_ray import demo

    parser = subparsers.add_parser("train", help="train a small GPT on a local Ray (the main job)",
                                   description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(parser)
    parser.set_defaults(func=demo.run)
