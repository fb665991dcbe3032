"""Driver processes for test_driver_loss.py, on a `ray start` cluster (RAY_ADDRESS, token auth).

    detached_run.py first OUT [ORPHAN_S]   start a detached run, write OUT/run.json after STEPS_BEFORE
                                           steps, then keep training slowly until killed
    detached_run.py second OUT RUN_ID      attach to the run, finish to STEPS and write OUT/final.pt

Both read the same batches (a function of the step index alone), so the second driver continues
exactly where the owners are.
"""

from __future__ import annotations

import json
import os
import sys

import ray
import torch

import zero_ray as zr
from zero_ray.models import mlp, mse_loss

STEPS, STEPS_BEFORE = 8, 3


def model() -> torch.nn.Module:
    return mlp(8, 2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


def first(out: str, orphan_s: float) -> None:
    config = zr.ZeroConfig(stage=2, world_size=2, health_interval_s=0.2, health_timeout_s=5.0,
                           elastic=zr.ElasticConfig(detached=True, orphan_timeout_s=orphan_s, redundancy="peer"))
    trainer = zr.ZeroTrainer(model, mse_loss, optimizer=zr.SGD(lr=0.1, momentum=0.9), config=config)
    for k in range(STEPS_BEFORE):
        trainer.step(batch(k))
    tmp = os.path.join(out, "run.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"run_id": trainer.run_id, "step": trainer.step_count, "pid": os.getpid()}, fh)
    os.replace(tmp, os.path.join(out, "run.json"))
    k = STEPS_BEFORE
    while k < STEPS - 1:  # the test SIGKILLs this process meanwhile; it never shuts the run down
        trainer.step(batch(k))
        k += 1
    threading_wait_forever()


def threading_wait_forever() -> None:
    import threading

    threading.Event().wait()


def second(out: str, run_id: str) -> None:
    trainer = zr.ZeroTrainer.attach(run_id, model, mse_loss)
    try:
        resumed, resumed_samples = trainer.step_count, trainer.samples_seen
        for k in range(resumed, STEPS):
            trainer.step(batch(k))
        torch.save(trainer.full_state_dict(), os.path.join(out, "final.pt"))
        summary = {"resumed": resumed, "resumed_samples": resumed_samples, "samples_seen": trainer.samples_seen,
                   "step": trainer.step_count, "world_size": trainer.world_size,
                   "events": list(trainer.events), "recoveries": [r.summary() for r in trainer.recoveries]}
    finally:
        trainer.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    ray.init(log_to_driver=False)
    if sys.argv[1] == "first":
        first(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 120.0)
    else:
        second(sys.argv[2], sys.argv[3])
