"""Time from an owner's death in the middle of a step to the next completed step.

    python -m benchmarks.recovery_time [--world-size 4 --stage 2 --redundancy peer --repeats 3]

An owner kills itself with ``ray.kill`` while computing its piece of a marked batch; the
driver detects the loss, restores the partition (peer memory or the last checkpoint), replays
and completes the step. Prints the recovery report of each repeat and writes
benchmarks/results/recovery_time.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import ray
import torch

import zero_ray as zr
from zero_ray.bench.faults import kill_on_marker
from zero_ray.models import mlp

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--redundancy", choices=["peer", "checkpoint"], default="peer")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ray.init(num_cpus=max(8, 2 * args.world_size), include_dashboard=False, log_to_driver=False)
    marks = tempfile.mkdtemp(prefix="zr-recovery-")
    n, per = args.world_size, 8
    g = torch.Generator().manual_seed(0)
    steps = 3 + 3 * args.repeats
    batches = [(torch.randn(n * per, args.width, generator=g), torch.randn(n * per, args.width, generator=g))
               for _ in range(steps)]
    kill_steps = [3 + 3 * i for i in range(args.repeats)]
    for i, s in enumerate(kill_steps):
        batches[s][0][per * (1 + i % (n - 1)), 0] = -101.0 - i  # first row of rank 1, 2, ... in turn
    cfg = zr.ZeroConfig(stage=args.stage, world_size=n, health_timeout_s=5.0,
                        elastic=zr.ElasticConfig(redundancy="peer" if args.redundancy == "peer" else "none"),
                        checkpoint=zr.CheckpointConfig(dir=os.path.join(marks, "ckpt")))
    trainer = zr.ZeroTrainer(functools.partial(mlp, args.width, args.depth), functools.partial(kill_on_marker, marks=marks),
                             optimizer=zr.AdamW(), config=cfg)
    rows = []
    try:
        for i, b in enumerate(batches):
            if args.redundancy == "checkpoint" and i in [s - 1 for s in kill_steps]:
                trainer.save_checkpoint(wait=True)
            t0 = time.perf_counter()
            metrics = trainer.step(b)
            took = time.perf_counter() - t0
            if i in kill_steps:
                r = trainer.recoveries[-1]
                rows.append({"step": i + 1, "kill_to_next_step_s": took, "detect_s": r.detect_s, "abort_s": r.abort_s,
                             "restore_s": r.restore_s, "replay_s": r.replay_s, "source": r.source,
                             "lost": sorted(r.lost), "world_size_after": r.world_size_after,
                             "normal_step_s": metrics["step_seconds"]})
                print(r.summary(), f"-> step completed {took:.2f}s after it started")
    finally:
        trainer.shutdown()
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
               f"{[round(x, 2) for x in os.getloadavg()]}")
    md = ["# Recovery time", "", f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} · {machine} · torch {torch.__version__} · "
          f"ray {ray.__version__}", "", f"{n} owners, stage {args.stage}, {args.depth} x Linear({args.width}), AdamW, "
          f"restore from {args.redundancy}; an owner kills itself mid-step. The step's time includes detection, "
          "abort, restore and replay (a replacement owner is started).", "",
          "| step | kill -> step done (s) | detect | abort | restore | replay | lost | owners after |",
          "|---:|---:|---:|---:|---:|---:|---|---:|"]
    md += [f"| {r['step']} | {r['kill_to_next_step_s']:.2f} | {r['detect_s']:.2f} | {r['abort_s']:.2f} | "
           f"{r['restore_s']:.2f} | {r['replay_s']:.2f} | {r['lost']} | {r['world_size_after']} |" for r in rows]
    RESULTS.mkdir(exist_ok=True)
    name = f"recovery_time_{args.redundancy}"
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
