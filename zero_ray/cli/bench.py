"""``zero-ray bench``: zero_ray side by side with DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed on the same model, data and optimizer."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from zero_ray.bench import compare

    parser = subparsers.add_parser("bench", help="benchmark zero_ray against PyTorch and DeepSpeed baselines",
                                   description=compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_arguments(parser)
    parser.set_defaults(func=compare.run)
