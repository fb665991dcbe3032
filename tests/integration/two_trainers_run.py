"""A driver process for test_quiet_shutdown.py: trains twice, as a notebook does (build a
ZeroTrainer, step, shut down, build another, step, shut down), then prints each run's losses as
one JSON line. Its stderr is its own, for the test to read.

    two_trainers_run.py GCS_ADDRESS [RUNS]

Heartbeats every 50 ms make a beat in flight likely when a trainer shuts down, the moment at
which a heartbeat loop that closed too early left gRPC an event for it (issue 42, item 5: before
the fix, 4 of 5 such processes printed 2 or 4 tracebacks; tests/control/test_control_beats.py
closes 50 readers for a surer check).
"""

from __future__ import annotations

import functools
import json
import sys

import ray
import torch

import zero_ray as zr
from zero_ray.models import mse_loss

STEPS = 6


def train_once(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    trainer = zr.ZeroTrainer(functools.partial(torch.nn.Linear, 4, 1), mse_loss, optimizer=zr.SGD(lr=0.1),
                             config=zr.ZeroConfig(stage=2, world_size=2, seed=0, health_interval_s=0.05))
    try:
        return [float(trainer.step((x, y))["loss"]) for _ in range(STEPS)]
    finally:
        trainer.shutdown()


def main(address: str, runs: int) -> None:
    ray.init(address=address, log_to_driver=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])  # a linear target: SGD's loss falls step by step
    losses = [train_once(x, y) for _ in range(runs)]
    ray.shutdown()
    print(json.dumps(losses), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
