"""Checkpoint save and load at scale, on local disk and on an S3-compatible store.

    python -m benchmarks.checkpoint_io [--width 4096 --depth 6 --world-size 4 --stage 3]
                                       [--load-world-size 3] [--s3 moto | --s3 s3://bucket/prefix]

Defaults: 6 x Linear(4096) = 100.7M parameters, 4 owners, stage 3, AdamW (master + 2 moments
= 12 bytes per parameter saved, 1.2 GB in all). One run of 4 owners saves to each store in turn;
a second run of ``--load-world-size`` owners (default: one fewer, so every load reshards) loads
each. Per store: the training stall of a save (every owner copying its slices to host memory),
the time until the checkpoint is committed, the write rate over the time after the stall
(bytes / (committed - stall): the owners' files written, or uploaded, in parallel), the load
time (each rank reading and verifying only its ranges) and each owner's peak RSS during save
and during load (VmHWM, reset before each phase).

``--s3 moto`` starts moto's S3 server (``pip install 'moto[server]'``) in a process of its own on
127.0.0.1 and points the standard AWS_* variables at it; ``--s3 s3://bucket/prefix`` uses the
store the environment names (AWS_ENDPOINT_URL, credentials, region). Writes
benchmarks/results/checkpoint_io.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 in its own process on 127.0.0.1, a bucket in it, and the AWS_* environment set
    (before Ray starts, so the owners inherit it). Yields the checkpoint root URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # bounded: until the server answers
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto's server did not come up on {endpoint}") from None
                time.sleep(0.2)
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_REGION="us-east-1")
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        yield "s3://bench/checkpoints"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _size(path: str) -> int:
    from zero_ray.checkpoint.store import CheckpointReader

    return sum(f.size for f in CheckpointReader(path).manifest.files)


def store_ceiling(root: str, mib: int = 256) -> dict[str, float]:
    """The store's own rates through zero_ray's storage layer, one stream, no training: one
    ``mib`` MiB upload, the same object read back as 4 MiB ranged GETs (a load's request size)
    and as one GET. What the checkpoint rows can reach at best on this store."""
    from zero_ray.checkpoint.location import open_location

    storage, where = open_location(root)
    path = storage.join(where, "ceiling-probe")
    data = os.urandom(2**20) * mib
    t0 = time.perf_counter()
    with storage.open_write(path) as fh:
        fh.write(data)
    put = time.perf_counter() - t0
    ranged = storage.open_ranged(path)
    t0 = time.perf_counter()
    for offset in range(0, len(data), 4 * 2**20):
        ranged.read(offset, 4 * 2**20)
    gets = time.perf_counter() - t0
    t0 = time.perf_counter()
    ranged.read(0, len(data))
    whole = time.perf_counter() - t0
    storage.remove(path)
    return {"put_mib_s": mib / put, "ranged_4mib_get_mib_s": mib / gets, "whole_get_mib_s": mib / whole}


def run(args: argparse.Namespace, stores: dict[str, str]) -> list[dict[str, Any]]:
    """Save to every store from one run, then load each into a run of another size."""
    ray.init(num_cpus=max(8, args.world_size * 2), include_dashboard=False, log_to_driver=False)
    model_fn = functools.partial(mlp, args.width, args.depth)
    load_n = args.load_world_size or max(1, args.world_size - 1)
    batch = (torch.randn(args.world_size * 2, args.width), torch.randn(args.world_size * 2, args.width))
    rows: dict[str, dict[str, Any]] = {}
    trainer = zr.ZeroTrainer(model_fn, mse_loss, config=zr.ZeroConfig(stage=args.stage, world_size=args.world_size,
                                                                       init_timeout_s=600))
    try:
        trainer.step(batch)
        pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in trainer.actors]
        before = trainer.full_state_dict() if trainer.num_params < 50_000_000 else None
        for store, root in stores.items():
            for p in pids:
                _reset_peak(p)
            t0 = time.perf_counter()
            path = trainer.save_checkpoint(root)
            stall = time.perf_counter() - t0
            trainer.wait_for_checkpoint()
            commit = time.perf_counter() - t0
            size = _size(path)
            rows[store] = {"store": store, "path": path, "checkpoint_bytes": size, "save_stall_s": stall,
                           "save_commit_s": commit, "write_mib_s": size / 2**20 / (commit - stall),
                           "save_peak_rss_mib": [_peak_mib(p) for p in pids]}
        num_params = trainer.num_params
    finally:
        trainer.shutdown()
    fresh = zr.ZeroTrainer(model_fn, mse_loss, config=zr.ZeroConfig(stage=args.stage, world_size=load_n,
                                                                     init_timeout_s=600))
    try:
        pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in fresh.actors]
        for store, row in rows.items():
            for p in pids:
                _reset_peak(p)
            t0 = time.perf_counter()
            fresh.load_checkpoint(row["path"])
            row["load_s"] = time.perf_counter() - t0
            row["load_peak_rss_mib"] = [_peak_mib(p) for p in pids]
            if before is not None:
                after = fresh.full_state_dict()
                assert all(torch.equal(after[k], before[k]) for k in before), f"{store}: loaded state differs"
    finally:
        fresh.shutdown()
    for row in rows.values():
        row.update(params=num_params, stage=args.stage, save_world_size=args.world_size, load_world_size=load_n)
        if row["path"].startswith("s3://"):
            row["ceiling"] = store_ceiling(stores[row["store"]])
    return list(rows.values())


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
               f"{[round(x, 2) for x in os.getloadavg()]}")
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    first = rows[0]
    command = "python -m benchmarks.checkpoint_io " + " ".join(sys.argv[1:])
    md = ["# Checkpoint save/load", "", f"{date} · {machine} · torch {torch.__version__} · ray {ray.__version__}",
          "", f"`{command.strip()}`", "",
          f"{first['params']:,} parameters, stage {args.stage}, AdamW; saved by {first['save_world_size']} owners, "
          f"loaded by {first['load_world_size']} (resharded); checkpoint {first['checkpoint_bytes'] / 2**20:,.0f} MiB.",
          "", "| store | save: training stall (host copy) s | save: until committed s | write MiB/s after the "
          "stall | load at another world size s | peak RSS per rank, save / load (MiB) |",
          "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['store']} | {r['save_stall_s']:.2f} | {r['save_commit_s']:.2f} | {r['write_mib_s']:.0f} | "
                  f"{r['load_s']:.2f} | {', '.join(f'{x:.0f}' for x in r['save_peak_rss_mib'])} / "
                  f"{', '.join(f'{x:.0f}' for x in r['load_peak_rss_mib'])} |")
    for r in rows:
        if "ceiling" in r:
            c = r["ceiling"]
            md += ["", f"{r['store']} by itself (one stream through zero_ray's storage layer, no training): a 256 MiB "
                   f"upload {c['put_mib_s']:.0f} MiB/s; read back as 4 MiB ranged GETs {c['ranged_4mib_get_mib_s']:.0f} "
                   f"MiB/s, as one GET {c['whole_get_mib_s']:.0f} MiB/s."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_io.json").write_text(json.dumps({"command": command.strip(), "machine": machine,
                                                            "date": date, "rows": rows}, indent=1))
    (RESULTS / "checkpoint_io.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--load-world-size", type=int, default=None, help="owners that load (default: one fewer)")
    ap.add_argument("--dir", default=None, help="local checkpoint root (default: a temp dir, removed afterwards)")
    ap.add_argument("--s3", default=None, metavar="moto|URL",
                    help="also an object store: 'moto' (a local moto server) or an s3:// root the environment reaches")
    args = ap.parse_args()
    local = args.dir or tempfile.mkdtemp(prefix="zr-ckpt-bench-")
    stores = {"local disk": local}
    try:
        if args.s3 == "moto":
            with moto_server() as url:
                stores["S3 (moto, local)"] = url
                rows = run(args, stores)
        else:
            if args.s3:
                stores[f"S3 ({os.environ.get('AWS_ENDPOINT_URL', 'AWS')})"] = args.s3
            rows = run(args, stores)
    finally:
        if args.dir is None:
            shutil.rmtree(local, ignore_errors=True)
    report(rows, args)


if __name__ == "__main__":
    main()
