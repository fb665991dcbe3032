"""Driver processes for test_driver_loss.py, on a `ray start` cluster (RAY_ADDRESS, token auth).

    detached_run.py first OUT [ORPHAN_S]   start a detached run, write OUT/run.json after STEPS_BEFORE
                                           steps, then keep training slowly until killed
    detached_run.py second OUT RUN_ID      attach to the run, finish to STEPS and write OUT/final.pt
    detached_run.py recorded RUN_ID...     print each run's desired size kept in Ray (JSON; null: none)

The owners keep their optimizer state on disk (``Offload(optimizer="nvme")``) throughout. Both
fit over the same token file (zero_ray.data.TokenFiles, whose order is a function of the
step alone), so the second driver continues exactly where the owners are, mid-epoch.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import ray
import torch
import torch.nn.functional as F

import zero_ray as zr
from zero_ray.driver import desired_size
from zero_ray.models import mlp

STEPS, STEPS_BEFORE = 8, 3
RESIZED = 2  # from the config's 3 before the first step  # 3 batches an epoch: the second driver attaches mid-epoch
SEQ, BATCH, SEED, WINDOW, BLOCK_TOKENS = 8, 12, 4, 2, 32


def model() -> torch.nn.Module:
    return mlp(8, 2)


def corpus_tokens() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 64, size=300).astype("<u2")


def source(out: str) -> zr.data.TokenFiles:
    """The run's data: a token file in ``out`` (written by the first driver)."""
    return zr.data.TokenFiles(os.path.join(out, "corpus.bin"), seq_len=SEQ, block_tokens=BLOCK_TOKENS, window=WINDOW)


def token_mse(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Each window's next tokens from its tokens, as floats."""
    return F.mse_loss(module(batch[:, :-1].float() / 64), batch[:, 1:].float() / 64)


def first(out: str, orphan_s: float) -> None:
    # The optimizer state on disk: the owners keep it in their files while no driver is attached.
    config = zr.ZeroConfig(stage=2, world_size=3, health_interval_s=0.2, health_timeout_s=5.0,
                           offload=zr.Offload(optimizer="nvme", path=os.path.join(out, "nvme")),
                           elastic=zr.ElasticConfig(detached=True, orphan_timeout_s=orphan_s, redundancy="peer"))
    corpus_tokens().tofile(os.path.join(out, "corpus.bin"))
    trainer = zr.ZeroTrainer(model, token_mse, optimizer=zr.SGD(lr=0.1, momentum=0.9), config=config)
    # The run's desired size is now 2, not the config's 3: the second driver must keep it (issue 46).
    trainer.resize(RESIZED)
    trainer.fit(source(out), global_batch_size=BATCH, steps=STEPS_BEFORE, seed=SEED, progress=False)
    tmp = os.path.join(out, "run.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        # The owners' pids: the test waits on them to end rather than polling `zero-ray status`.
        owner_pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in trainer.actors]
        json.dump({"run_id": trainer.run_id, "step": trainer.step_count, "pid": os.getpid(), "owner_pids": owner_pids,
                   "recorded": desired_size.recorded(trainer.run_id)}, fh)
    os.replace(tmp, os.path.join(out, "run.json"))
    # The test SIGKILLs this process meanwhile; it never shuts the run down.
    trainer.fit(source(out), global_batch_size=BATCH, steps=STEPS - 1, seed=SEED, progress=False)
    threading_wait_forever()


def threading_wait_forever() -> None:
    import threading

    threading.Event().wait()


def second(out: str, run_id: str) -> None:
    trainer = zr.ZeroTrainer.attach(run_id, model, token_mse)
    try:
        resumed, resumed_samples = trainer.step_count, trainer.samples_seen
        trainer.fit(source(out), global_batch_size=BATCH, steps=STEPS, seed=SEED, progress=False)
        torch.save(trainer.full_state_dict(), os.path.join(out, "final.pt"))
        summary = {"resumed": resumed, "resumed_samples": resumed_samples, "samples_seen": trainer.samples_seen,
                   "step": trainer.step_count, "world_size": trainer.world_size,
                   "desired_world_size": trainer.desired_world_size,
                   "nvme": [r["nvme"] for r in trainer.memory_report()],
                   "events": list(trainer.events), "recoveries": [r.summary() for r in trainer.recoveries]}
    finally:
        trainer.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    ray.init(log_to_driver=False)
    if sys.argv[1] == "first":
        first(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 120.0)
    elif sys.argv[1] == "recorded":
        print(json.dumps({run_id: desired_size.recorded(run_id) for run_id in sys.argv[2:]}))
    else:
        second(sys.argv[2], sys.argv[3])
