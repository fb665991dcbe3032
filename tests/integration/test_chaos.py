"""Chaos: 60 steps of ``fit`` at stage 3 with peer redundancy while owners' processes are
SIGKILLed every ~8 steps and the run resizes every ~15 (seeded), against one process on the
documented sample order (SGD, 1e-6)."""

from __future__ import annotations

import os
import random
import signal

import pytest
import ray
import torch
from torch.utils.data import TensorDataset

import zero_ray as zr
from fit_order import reference_batches
from zero_ray.models import mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS, BATCH, SEED = 60, 12, 5
SIZES = (3, 4)  # the resizes alternate between these


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(33)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def _schedule(seed: int) -> tuple[dict[int, int], dict[int, int]]:
    """Seeded: after which steps to SIGKILL which rank (every 6-10 steps), and to resize to
    which size (every 13-17)."""
    rng = random.Random(seed)
    kills, resizes = {}, {}
    step = rng.randint(6, 10)
    while step < STEPS - 2:
        kills[step] = rng.randrange(SIZES[0])  # a rank every size has
        step += rng.randint(6, 10)
    step, size = rng.randint(13, 17), 0
    while step < STEPS - 2:
        size = 1 - size
        resizes[step] = SIZES[size]
        step += rng.randint(13, 17)
    return kills, resizes


@pytest.mark.timeout(600)
def test_sixty_steps_of_kills_and_resizes_end_equal_to_the_uninterrupted_run() -> None:
    opt = zr.SGD(lr=0.05, momentum=0.9)
    dataset = _dataset()
    ref, _ = single_process(_model, mse_loss, opt, reference_batches(dataset, global_batch_size=BATCH, steps=STEPS, seed=SEED))
    kills, resizes = _schedule(seed=11)
    config = zr.ZeroConfig(stage=3, world_size=SIZES[0], health_interval_s=0.2, health_timeout_s=5.0,
                           max_failures=len(kills) + 2, collective_timeout_s=600,
                           elastic=zr.ElasticConfig(redundancy="peer", max_world_size=max(SIZES)),
                           stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)))
    trainer = zr.ZeroTrainer(_model, mse_loss, optimizer=opt, config=config)
    done: list[str] = []

    def chaos(metrics: dict) -> None:
        step = metrics["step"]
        if step in resizes:
            trainer.resize(resizes[step])
            done.append(f"resize {resizes[step]} after step {step}")
        if step in kills:  # the run may be smaller meanwhile: continuing on survivors until replacements join
            rank = kills[step] % trainer.world_size
            pid = ray.get(trainer.actors[rank].node.remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGKILL)
            done.append(f"SIGKILL rank {rank} of {trainer.world_size} after step {step}")

    try:
        result = trainer.fit(dataset, global_batch_size=BATCH, steps=STEPS, seed=SEED, progress=False,
                             callback=chaos)
        got = trainer.full_state_dict()
        outcomes = [r.outcome.value for r in trainer.recoveries]
    finally:
        trainer.shutdown()
    print("; ".join(done), "| recoveries:", outcomes)
    assert result["step"] == STEPS
    assert len(done) == len(kills) + len(resizes) and len(kills) >= 6 and len(resizes) >= 3
    assert outcomes == ["restored"] * len(kills)
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-6
