"""How long ``fit``'s scan of a Ray Dataset takes, and how many Ray worker processes it starts, against the block count.

    python -m benchmarks.ray_blocks [--blocks 200,2000,20000] [--cpus N] [--raydata FILE] [--json OUT]

For each block count a fresh local Ray (``--cpus`` logical CPUs, default the machine's) makes
``ray.data.from_items`` of one row per block (a sample of the main job's shape: 129 token ids),
then times:

- scan: ``zero_ray.data.RayDataset(ds).scan()``, what ``fit`` runs first on a Ray Dataset;
- to_arrow_refs: ``Dataset.to_arrow_refs()`` on the same (Arrow) blocks, and on as many blocks
  made by ``ray.data.from_pandas`` (pandas blocks, which it converts in a Ray task each).

Beside each time, the Ray worker processes that appeared during it (the raylet's children,
sampled every 20 ms: Ray ends idle workers about a second after their tasks, so a count taken at
the end would miss them). ``--raydata FILE`` times the ``RayDataset`` of another ``raydata.py``
(an older one: ``git show 46124fa:zero_ray/data/raydata.py > /tmp/old_raydata.py``). Prints a
Markdown table (and writes JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.ray_workers import workers_started

TOKENS = 129


def raydataset_class(path: str | None) -> Any:
    """``RayDataset`` from ``path`` (another raydata.py), or the installed one."""
    if path is None:
        from zero_ray.data import RayDataset

        return RayDataset
    spec = importlib.util.spec_from_file_location("raydata_under_test", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.RayDataset


def timed(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """Seconds ``fn`` took, the worker processes that appeared meanwhile, and its result."""
    with workers_started() as new:
        start = time.perf_counter()
        try:
            out = fn()
        finally:
            elapsed = time.perf_counter() - start
    return elapsed, len(new), out


def measure(blocks: int, cpus: int, raydata: Any) -> dict[str, Any]:
    """One block count on a fresh local Ray: the scan, and to_arrow_refs on Arrow and pandas blocks."""
    import numpy as np
    import pandas as pd
    import ray
    import ray.data

    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        rng = np.random.default_rng(0)
        rows = rng.integers(0, 256, size=(blocks, TOKENS))
        ds = ray.data.from_items([{"tokens": r.tolist()} for r in rows], override_num_blocks=blocks)
        scan_s, scan_workers, layout = timed(lambda: raydata(ds).scan())
        assert len(layout.block_sizes) == blocks and sum(layout.block_sizes) == blocks, layout.block_sizes[:5]
        arrow_s, arrow_workers, _ = timed(ds.to_arrow_refs)
        frames = ray.data.from_pandas([pd.DataFrame({"tokens": [r.tolist()]}) for r in rows])
        pandas_s, pandas_workers, refs = timed(lambda: ray.get(frames.to_arrow_refs()))
        assert len(refs) == blocks
        return {"blocks": blocks, "cpus": cpus, "scan_s": scan_s, "scan_workers": scan_workers,
                "to_arrow_refs_s": arrow_s, "to_arrow_refs_workers": arrow_workers,
                "to_arrow_refs_pandas_s": pandas_s, "to_arrow_refs_pandas_workers": pandas_workers}
    finally:
        ray.shutdown()


def render(results: list[dict[str, Any]], *, label: str) -> str:
    lines = [f"{label}; {results[0]['cpus'] if results else '?'} logical CPUs; load {os.getloadavg()[0]:.1f} at the end",
             "", "| blocks | scan s | workers started | to_arrow_refs s (Arrow blocks) | workers | "
             "to_arrow_refs + get s (pandas blocks) | workers |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['blocks']:,} | {r['scan_s']:.3f} | {r['scan_workers']} | {r['to_arrow_refs_s']:.3f} | "
                     f"{r['to_arrow_refs_workers']} | {r['to_arrow_refs_pandas_s']:.2f} | "
                     f"{r['to_arrow_refs_pandas_workers']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_blocks", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="200,2000,20000", help="comma-separated block counts")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    p.add_argument("--raydata", default=None, help="a raydata.py whose RayDataset to time (default: the installed one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    counts = [int(b) for b in args.blocks.split(",") if b]
    if not counts or min(counts) < 1 or args.cpus < 1:
        p.error("--blocks takes positive block counts and --cpus a positive count")
    raydata = raydataset_class(args.raydata)
    results = []
    for blocks in counts:
        results.append(measure(blocks, args.cpus, raydata))
        print(f"{blocks} blocks: scan {results[-1]['scan_s']:.3f} s, {results[-1]['scan_workers']} workers", flush=True)
    print(render(results, label=f"RayDataset from {args.raydata or 'zero_ray.data'}"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
