"""Checkpoint save and load at scale: time and peak memory per rank.

    python -m benchmarks.checkpoint_io [--width 4096 --depth 6 --world-size 4 --stage 3]

Defaults: 6 x Linear(4096) = 100.7M parameters, 4 owners, stage 3, AdamW (master + 2 moments
= 12 bytes per parameter saved, 1.2 GB in all). Reports the training stall of a save (every
owner copying its slices to host memory), the time until the checkpoint is committed, the
load time (each rank reading and verifying only its ranges) and each owner's peak RSS during
save and during load (VmHWM, reset before each phase). Writes benchmarks/results/checkpoint_io.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import ray
import torch

import zero_ray as zr
from zero_ray.models import mlp, mse_loss

RESULTS = Path(__file__).parent / "results"


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:  # "5" resets VmHWM to the current RSS
        fh.write("5")


def _peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--load-world-size", type=int, default=None, help="reshard on load (default: same size)")
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    ray.init(num_cpus=max(8, args.world_size * 2), include_dashboard=False, log_to_driver=False)
    model_fn = functools.partial(mlp, args.width, args.depth)
    root = args.dir or tempfile.mkdtemp(prefix="zr-ckpt-bench-")
    load_n = args.load_world_size or args.world_size
    cfg = zr.ZeroConfig(stage=args.stage, world_size=args.world_size, init_timeout_s=600)
    batch = (torch.randn(args.world_size * 2, args.width), torch.randn(args.world_size * 2, args.width))
    trainer = zr.ZeroTrainer(model_fn, mse_loss, config=cfg)
    try:
        trainer.step(batch)
        pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in trainer.actors]
        for p in pids:
            _reset_peak(p)
        t0 = time.perf_counter()
        path = trainer.save_checkpoint(root)
        stall = time.perf_counter() - t0
        trainer.wait_for_checkpoint()
        commit = time.perf_counter() - t0
        save_peak = [_peak_mib(p) for p in pids]
        before = trainer.full_state_dict() if trainer.num_params < 50_000_000 else None
    finally:
        trainer.shutdown()
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    fresh = zr.ZeroTrainer(model_fn, mse_loss, config=zr.ZeroConfig(stage=args.stage, world_size=load_n,
                                                                     init_timeout_s=600))
    try:
        pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in fresh.actors]
        for p in pids:
            _reset_peak(p)
        t0 = time.perf_counter()
        fresh.load_checkpoint(path)
        load = time.perf_counter() - t0
        load_peak = [_peak_mib(p) for p in pids]
        if before is not None:
            after = fresh.full_state_dict()
            assert all(torch.equal(after[k], before[k]) for k in before)
    finally:
        fresh.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    row = {"params": trainer.num_params, "stage": args.stage, "save_world_size": args.world_size,
           "load_world_size": load_n, "checkpoint_bytes": size, "save_stall_s": stall, "save_commit_s": commit,
           "load_s": load, "save_peak_rss_mib": save_peak, "load_peak_rss_mib": load_peak,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
                      f"{[round(x, 2) for x in os.getloadavg()]}", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    md = ["# Checkpoint save/load", "", f"{row['date']} · {row['machine']} · torch {torch.__version__} · ray {ray.__version__}",
          "", f"{row['params']:,} parameters, stage {args.stage}, AdamW; saved by {args.world_size} owners, loaded by "
          f"{load_n}; checkpoint {size / 2**20:,.0f} MiB on local disk.", "",
          "| phase | seconds | peak RSS per rank (MiB) |", "|---|---:|---|",
          f"| save: training stall (host copy) | {stall:.2f} | {', '.join(f'{x:.0f}' for x in save_peak)} |",
          f"| save: until committed (files durable, manifest, rename) | {commit:.2f} | |",
          f"| load (ranged, verified reads + publish) | {load:.2f} | {', '.join(f'{x:.0f}' for x in load_peak)} |"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_io.json").write_text(json.dumps(row, indent=1))
    (RESULTS / "checkpoint_io.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
