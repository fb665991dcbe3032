"""Per-step control overhead: the driver's gRPC round trip to every owner, without compute.

    python -m benchmarks.control_overhead --world-size 4 --repeats 200

Prints the median and p90 of (a) one Stats call fanned out to all owners concurrently and
waited for (the shape of a step's control traffic), and (b) a whole step of a 2-parameter model,
whose compute is negligible, so what remains is control plus a tiny collective.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

import zero_ray as zr


def _model() -> torch.nn.Module:
    return torch.nn.Linear(1, 1, bias=True)


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).pow(2).mean()


def _summary(samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples)
    return f"median {statistics.median(ms):6.2f} ms   p90 {ms[int(0.9 * (len(ms) - 1))]:6.2f} ms   min {ms[0]:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not ray.is_initialized():
        ray.init(num_cpus=max(4, args.world_size), include_dashboard=False, log_to_driver=False)
    trainer = zr.ZeroTrainer(_model, _loss, optimizer=zr.SGD(lr=0.01),
                             config=zr.ZeroConfig(stage=1, world_size=args.world_size))
    try:
        pool = trainer._pool
        rpc, steps = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            pool.stats(timeout_s=5.0)
            rpc.append(time.perf_counter() - t)
        batch = torch.randn(args.world_size * 2, 1)
        for _ in range(10):
            trainer.step(batch)
        for _ in range(args.repeats):
            steps.append(trainer.step(batch)["step_seconds"])
    finally:
        trainer.shutdown()
    print(f"{args.world_size} owners, CPU, {args.repeats} repeats")
    print(f"control round trip (Stats to all owners): {_summary(rpc)}")
    print(f"whole step, negligible compute:           {_summary(steps)}")


if __name__ == "__main__":
    main()
