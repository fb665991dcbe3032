"""``python -m benchmarks.stage3_capacity``: the largest model each ZeRO stage trains here.

Four actors, each with its address space capped (RLIMIT_AS: what it maps when ``model_fn``
starts plus ``--cap-mib``), train a stack of Linear(WIDTH) layers with AdamW in fp32 for two
steps; a rough bisection over the depth finds the deepest stack each stage builds and trains.
Stage 3 uses the low-memory construction (stages 0-2 build the whole model on every rank, as
they must). The cap stands in for "one actor's memory" so the search never pressures the
shared machine; the paper's formula scales the answer to any other per-actor memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import ray
import torch

import zero_ray as zr
from benchmarks.harness.probe import cap_address_space
from benchmarks.harness.ray_env import runtime_env
from zero_ray.config import Stage3Config
from zero_ray.models import mlp, mse_loss


def capped_mlp(cap_bytes: int, width: int, depth: int) -> torch.nn.Module:
    """Cap this actor's address space at what it maps now plus ``cap_bytes``, then build."""
    cap_address_space(cap_bytes)
    return mlp(width, depth)


def trains(stage: int, depth: int, args: argparse.Namespace) -> bool:
    model_fn = functools.partial(capped_mlp, args.cap_mib * 2**20, args.width, depth)
    stage3 = {"stage3": Stage3Config(init="low_memory")} if stage == 3 else {}
    cfg = zr.ZeroConfig(stage=stage, world_size=args.world_size, init_timeout_s=900, step_timeout_s=900, **stage3)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4 * args.world_size, args.width, generator=g),
             torch.randn(4 * args.world_size, args.width, generator=g))
    try:
        with zr.ZeroTrainer(model_fn, mse_loss, optimizer=zr.AdamW(lr=1e-4), config=cfg) as trainer:
            for _ in range(2):
                trainer.step(batch)
        return True
    except zr.ZeroRayError as err:
        print(f"  stage {stage} depth {depth}: {str(err).splitlines()[0][:160]}", flush=True)
        return False


def largest(stage: int, args: argparse.Namespace) -> int:
    """Deepest stack that trains, to within ``--resolution`` layers (0 if none)."""
    lo, hi = 0, args.start
    while trains(stage, hi, args):  # grow until it fails
        print(f"  stage {stage} depth {hi}: ok", flush=True)
        lo, hi = hi, hi * 2
    while hi - lo > args.resolution:
        mid = (lo + hi) // 2
        ok = trains(stage, mid, args)
        print(f"  stage {stage} depth {mid}: {'ok' if ok else 'no'}", flush=True)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cap-mib", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--start", type=int, default=16, help="first depth tried")
    ap.add_argument("--resolution", type=int, default=8, help="bisection stops within this many layers")
    ap.add_argument("--stages", default="0,1,2,3")
    args = ap.parse_args()
    # The owners call cap_address_space, from benchmarks.harness: the package travels with the job.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
    per_layer = args.width * args.width + args.width
    out: dict[str, object] = {"config": vars(args) | {"time": time.strftime("%Y-%m-%d %H:%M:%S")}}
    for stage in (int(s) for s in args.stages.split(",")):
        depth = largest(stage, args)
        out[f"stage {stage}"] = {"depth": depth, "params": depth * per_layer,
                                 "fp32_model_mib": round(depth * per_layer * 4 / 2**20, 1)}
        print(json.dumps(out[f"stage {stage}"]), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
