"""Run by test_capacity.py in its own process, on a local Ray of exactly 4 CPUs (the session's
Ray may hold CPUs of other tests' actors a while after they end): placement follows membership.
A run started at 3 with max_world_size=4 stays at 3; an owner SIGKILLed twice is replaced both
times (the run continues on the survivors until the replacement, started meanwhile, joins);
resize(4) fits; resize(2) gives 2 CPUs back. Then, on the same Ray once all 4 CPUs are free again,
resize_after_loss_run.run at stages 1 and 3: one Ray and one interpreter start for both.

Prints one JSON line per run with what it saw; the parent test asserts on them.
"""

from __future__ import annotations

import json
import os
import signal
import time

import ray
import torch

import zero_ray as zr
from resize_after_loss_run import run as resize_after_loss
from zero_ray.models import mlp, mse_loss


def free_cpus(expect: float, timeout_s: float = 30.0) -> float:
    """Ray's free CPUs once they equal ``expect`` (a dead actor's slot comes back asynchronously),
    or what they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free == expect or time.monotonic() > deadline:
            return free
        time.sleep(0.2)  # polling Ray's resource view


def slots() -> dict[str, object]:
    """What placement did through a loss, a replacement, a grow and a shrink."""
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g))
    cfg = zr.ZeroConfig(stage=2, world_size=3, health_interval_s=0.2, health_timeout_s=5.0,
                        elastic=zr.ElasticConfig(redundancy="peer", max_world_size=4, grow_check_s=0.0))
    trainer = zr.ZeroTrainer(lambda: mlp(8, 2), mse_loss, optimizer=zr.SGD(lr=0.1), config=cfg)
    seen: dict[str, object] = {}
    try:
        sizes = []
        for _ in range(3):  # room for a 4th owner, but nothing asks for one
            trainer.step(batch)
            sizes.append(trainer.world_size)
        seen["before_loss"] = sizes
        seen["free_at_3"] = free_cpus(1.0)
        after = []
        for kill in range(2):
            pid = ray.get(trainer.actors[1].node.remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGKILL)
            trainer.step(batch)  # recovered onto the survivors at once, a replacement starting
            seen.setdefault("restored_to", []).append(trainer.recoveries[-1].world_size_after)
            deadline = time.monotonic() + 60
            while trainer.world_size < 3 and time.monotonic() < deadline:
                trainer.step(batch)  # the replacement joins at the first step boundary it is up
            after.append(trainer.world_size)
        seen["after_kills"] = after
        seen["free_after_kills"] = free_cpus(1.0)
        seen["recoveries"] = [r.summary() for r in trainer.recoveries]
        seen["resize_4"] = trainer.resize(4)["world_size"]
        trainer.step(batch)
        seen["free_at_4"] = free_cpus(0.0)
        seen["resize_2"] = trainer.resize(2)["world_size"]
        trainer.step(batch)
        seen["free_at_2"] = free_cpus(2.0)
    finally:
        trainer.shutdown()
    seen["free_after_shutdown"] = free_cpus(4.0)
    return seen


def main() -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(json.dumps({"run": "slots", **slots()}), flush=True)
        for stage in (1, 3):
            print(json.dumps({"run": "resize_after_loss", **resize_after_loss(stage)}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
