"""Which hand-written files one stage-2 ``fit`` step runs through, measured, with their lines.

    python -m benchmarks.step_path [--source dataset|tokens] [--stage 2] [--world-size 2] [--json OUT]

A profile hook on every thread of the driver and of every owner (``harness/call_census``,
installed in the owners by the job's runtime env) counts calls per zero_ray file. One trainer
runs ``fit`` three times, to 2, 4 and 8 steps, and the counts are read after each; a file is on
a step's path when its calls grow with the steps: (calls over the last 4 steps) - (calls over the
2 before) > 0, which cancels each ``fit`` call's own setup (data shipped or scanned, progress,
the order). What the heartbeats do in that time is counted too and shows as a few calls per
step at most; the table gives calls per step so they can be told apart. ``--source tokens``
reads a ``zr.data.TokenFiles`` corpus the owners open themselves; ``dataset`` ships a list of
token windows (a map-style dataset). Prints a Markdown table, in the order of the issue's
trace (driver, control, owner, collective, core, data), with each file's line count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import call_census

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zero_ray"
ORDER = ("driver", "control", "owner", "collective", "core", "data", "checkpoint", "compat")


def _per_step(before: Counter[str], middle: Counter[str], after: Counter[str], steps: int) -> dict[str, float]:
    # (last 4 steps) - (the 2 before) = 2 steps' calls, each fit call's setup cancelled.
    out = {}
    for name in set(after) | set(middle):
        second = (after[name] - middle[name]) - (middle[name] - before[name])
        if second > 0:
            out[name] = second / steps
    return out


def _rel(name: str) -> str:
    return os.path.relpath(name, ROOT)


def _sort_key(rel: str) -> tuple[int, str]:
    parts = rel.split(os.sep)
    area = parts[1] if len(parts) > 2 else "zz"
    return (ORDER.index(area) if area in ORDER else len(ORDER), rel)


def measure(source_kind: str, stage: int, world_size: int) -> dict[str, dict[str, float]]:
    import ray

    import zero_ray as zr
    from zero_ray.models import GPT, GPTConfig, lm_loss

    census = tempfile.mkdtemp(prefix="zr_census_")
    ray.init(num_cpus=world_size + 1, include_dashboard=False, runtime_env={
        "worker_process_setup_hook": "benchmarks.harness.call_census.install_from_env",
        "env_vars": {call_census.ENV: census, "PYTHONPATH": str(ROOT)}})
    call_census.install(census)  # the driver process itself
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
    data_dir = tempfile.mkdtemp(prefix="zr_tokens_")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=4000).astype("<u2")
    if source_kind == "tokens":
        tokens.tofile(os.path.join(data_dir, "train-0.bin"))
        source = zr.data.TokenFiles(os.path.join(data_dir, "train-*.bin"), seq_len=8, block_tokens=256)
    else:
        t = torch.from_numpy(tokens.astype("int64"))
        source = [t[i:i + 9] for i in range(0, len(t) - 9, 9)]
    config = zr.ZeroConfig(stage=stage, world_size=world_size, bucket_bytes=4096)
    counts = []
    with zr.ZeroTrainer(functools.partial(GPT, cfg), lm_loss, optimizer=zr.SGD(lr=0.1), config=config) as trainer:
        for steps in (2, 4, 8):
            trainer.fit(source, global_batch_size=4, steps=steps, progress=False)
            time.sleep(0.3)  # a benchmark: let every process's census flush (50 ms period)
            counts.append(call_census.read(census))
    ray.shutdown()
    driver = os.getpid()
    out: dict[str, dict[str, float]] = {}
    for side in ("driver", "owners"):
        def total(snapshot: dict[int, Counter[str]]) -> Counter[str]:
            c: Counter[str] = Counter()
            for pid, n in snapshot.items():
                if (pid == driver) == (side == "driver"):
                    c.update(n)
            return c
        per = _per_step(*(total(s) for s in counts), steps=2)
        for name, calls in per.items():
            out.setdefault(_rel(name), {})[side] = calls / (world_size if side == "owners" else 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("dataset", "tokens"), default="dataset")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    found = measure(args.source, args.stage, args.world_size)
    rows = sorted(found, key=_sort_key)
    print(f"stage {args.stage}, {args.world_size} owners, fit over a {args.source} source: files whose calls grow "
          "with the steps (calls per step: driver, per owner)\n")
    print("| # | file | lines | driver calls/step | owner calls/step |")
    print("|---|---|---|---|---|")
    lines_total = 0
    for i, rel in enumerate(rows, 1):
        lines = sum(1 for _ in open(ROOT / rel, encoding="utf-8"))
        lines_total += lines
        d, o = found[rel].get("driver", 0.0), found[rel].get("owners", 0.0)
        print(f"| {i} | {rel} | {lines} | {d:g} | {o:g} |")
    generated = [r for r in rows if "_generated" in r or r.endswith("core/records.py")]
    print(f"\n{len(rows)} files, {lines_total} lines; of them generated: {len(generated)} ({', '.join(generated)})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
