"""``python -m benchmarks.stage3_step_time``: stage-3 step time against PyTorch DDP.

The issue's workload: 8 x Linear(1024) MLP, batch 32 per rank, 2 ranks, AdamW, fp32, gloo on
CPU. Every system is timed by the driver's wall clock around one step (batch hand-off, forward,
backward, gradient exchange, update, reply), as the project's benchmark compares them, after
warm-up steps, as medians over interleaved rounds so that machine noise hits all alike. Also
runs stage 3 without prefetch and stage 2 for reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import ray
import torch

import zero_ray as zr
from zero_ray.config import Stage3Config
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import DDPRun


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch-per-rank", type=int, default=32)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    ray.init(num_cpus=max(8, 2 * args.world_size), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    model_fn = functools.partial(mlp, args.width, args.depth)
    n = args.batch_per_rank * args.world_size
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))
    opt = zr.AdamW(lr=1e-4)

    def timed(step: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            step()
            return time.perf_counter() - start

        return run

    def zero(stage: int, **stage3: object) -> tuple[object, Callable[[], float]]:
        cfg = zr.ZeroConfig(stage=stage, world_size=args.world_size,
                            **({"stage3": Stage3Config(**stage3)} if stage == 3 else {}))
        trainer = zr.ZeroTrainer(model_fn, mse_loss, optimizer=opt, config=cfg)
        return trainer, timed(lambda: trainer.step(batch))

    ddp = DDPRun(model_fn, mse_loss, opt, world_size=args.world_size)
    systems: dict[str, tuple[object, Callable[[], float]]] = {"ddp": (ddp, timed(lambda: ddp.step(batch)))}
    systems["zero stage 3"] = zero(3)
    systems["zero stage 3, no prefetch"] = zero(3, prefetch_depth=0)
    systems["zero stage 2"] = zero(2)
    times: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for _, step in systems.values():
            for _ in range(args.warmup):
                step()
        for _ in range(args.rounds):
            for name, (_, step) in systems.items():
                times[name] += [step() for _ in range(args.steps)]
        comm = systems["zero stage 3"][0].comm_report()[0]  # type: ignore[attr-defined]
    finally:
        for system, _ in systems.values():
            system.shutdown()  # type: ignore[attr-defined]
    base = statistics.median(times["ddp"])
    result = {name: {"median_ms": round(1e3 * statistics.median(t), 2),
                     "vs_ddp": round(statistics.median(t) / base, 3)} for name, t in times.items()}
    result["stage3_bytes_sent_per_rank"] = comm
    result["config"] = vars(args) | {"time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
