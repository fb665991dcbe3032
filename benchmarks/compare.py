"""Side-by-side benchmark of zero_ray against PyTorch DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed ZeRO: the same model, global batch, data and AdamW in every system, each system's
ranks as one-CPU Ray actors on gloo. Writes JSON, markdown and a PNG under the output
directory and prints the markdown table.

Systems: single, ddp, torch-zero, fsdp2, ds1, ds2, ds3, zero0, zero1, zero2, zero3 (all, the
default). Compiled ones (each repeated block's forward torch.compile'd: by hand in the torch
systems, ZeroConfig(compile=True) in zero_ray's): single+compile, ddp+compile, zero0+compile ...
zero3+compile; `--systems compiled` runs single, ddp and zero1-3 each beside its compiled twin and
reports each compiled system's speedup over its eager twin and against single-process torch's.
Models: mlp (mlp(1024, 8), batch 32 per rank, MSE), gpt (a small GPT, batch 8 per rank).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness.report import read_json, render_markdown, write_json, write_png
from benchmarks.harness.runner import DEFAULT_SYSTEMS, SYSTEM_GROUPS, BenchConfig, run_benchmark
from benchmarks.harness.systems import SYSTEMS
from benchmarks.harness.workloads import WORKLOADS
from zero_ray.errors import ZeroRayError

DEFAULT_OUTPUT = os.path.join("benchmarks", "results")
BASENAME = "compare"


def expand_names(text: str, choices: Sequence[str], groups: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The names a comma-separated list selects, each group (``all``, ``compiled``) expanded in
    place, in order, each name once; ValueError naming what is unknown."""
    names: list[str] = []
    for item in (n.strip() for n in text.split(",")):
        if item:
            names += groups.get(item, [item])
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise ValueError(f"{unknown or text!r}; choose from {', '.join(choices)} or {' / '.join(groups)}")
    return tuple(dict.fromkeys(names))


def _names(kind: str, choices: Sequence[str], groups: Mapping[str, Sequence[str]]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        try:
            return expand_names(text, choices, groups)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"unknown {kind} {err}") from None
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (``python -m benchmarks.compare``)."""
    parser.add_argument("--systems", type=_names("systems", tuple(SYSTEMS), SYSTEM_GROUPS), default=DEFAULT_SYSTEMS,
                        help="comma-separated systems and groups: 'all' (the default: " + ",".join(DEFAULT_SYSTEMS)
                             + "), 'compiled' (" + ",".join(SYSTEM_GROUPS["compiled"]) + "); any of "
                             + ",".join(SYSTEMS))
    parser.add_argument("--model", type=_names("models", tuple(WORKLOADS), {"all": tuple(WORKLOADS)}),
                        default=tuple(WORKLOADS), help="mlp, gpt or all (default), or a comma-separated list")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per distributed system (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=float, default=1e-2, help="AdamW weight decay (default 0.01)")
    parser.add_argument("--atol", type=float, default=1e-4,
                        help="max abs deviation from the single process reported as a match (default 1e-4)")
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--mlp-depth", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on every wait, seconds (default 600)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT,
                        help=f"where {BASENAME}.json/.md/.png go (default {DEFAULT_OUTPUT})")
    parser.add_argument("--no-png", action="store_true", help="skip the chart")
    parser.add_argument("--render", metavar="JSON",
                        help="render an existing results file (table, markdown, PNG) instead of running")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(systems=tuple(args.systems), models=tuple(args.model), world_size=args.world_size,
                       steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr,
                       weight_decay=args.weight_decay, atol=args.atol, mlp_width=args.mlp_width,
                       mlp_depth=args.mlp_depth, timeout_s=args.timeout)


def run(args: argparse.Namespace) -> int:
    """Run (or re-render) the benchmark; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.render:
            results = read_json(args.render)
        else:
            config = config_from_args(args)
            progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
            results = run_benchmark(config, progress=progress)
    except (ZeroRayError, OSError) as err:
        print(f"benchmarks.compare: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    stem = os.path.join(args.output_dir, BASENAME)
    markdown = render_markdown(results)
    if not args.render:
        write_json(results, stem + ".json")
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(markdown)
    note = "PNG skipped (--no-png)" if args.no_png else write_png(results, stem + ".png")
    print(markdown)
    written = [stem + ext for ext in ((".md",) if args.render else (".json", ".md"))]
    if note is None:
        written.append(stem + ".png")
    print("wrote " + ", ".join(written) + (f"; {note}" if note else ""), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
