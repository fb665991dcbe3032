"""Trials in fresh processes, and their results written as a table: what the benchmarks that
compare a few one-owner trials (``benchmarks.offload``, ``benchmarks.compile_start``) share.

Each trial is the benchmark's own module run again with ``--child``; the child prints its row
as JSON on its last line of output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def add_trial_arguments(parser: argparse.ArgumentParser, *, timeout_s: float) -> None:
    """The arguments every such benchmark takes: the bound on each trial, where the results go,
    and (hidden) ``--child``, which the trials are run with."""
    parser.add_argument("--timeout", type=float, default=timeout_s, help="bound on each trial, seconds")
    parser.add_argument("--results-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def run_child(module: str, args: Sequence[str], *, name: str, timeout_s: float,
              env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module --child *args`` and return the JSON object it printed last;
    ``name`` names the trial in the error when it fails."""
    cmd = [sys.executable, "-m", module, "--child", *args]
    out = subprocess.run(cmd, env=None if env is None else dict(env), capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {name} trial failed (exit {out.returncode}): {out.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def write_results(results_dir: str, stem: str, data: Mapping[str, Any], table: str) -> None:
    """Write ``stem.json`` (``data``) and ``stem.md`` (``table``) under ``results_dir`` and print
    the table."""
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=2)
    with open(os.path.join(results_dir, f"{stem}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
