"""A resize shortly after a loss, while the loss's replacement is still starting (a regression:
the replacement held a slot that the grow did not count, so ``resize(4)`` on a 4-slot cluster
failed with "needs 2 more slots ... but the cluster has 1 free").

The run has exactly four CPU slots: the session's other CPUs are held by a placement group."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

import zero_ray as zr
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MLP_FN = functools.partial(mlp, 16, 3)
SLOTS = 4


@pytest.fixture
def four_slots() -> Iterator[None]:
    """Hold every free CPU of the session's Ray but four, for the test's duration."""
    spare = int(ray.available_resources().get("CPU", 0.0)) - SLOTS
    assert spare >= 0, f"the test session's Ray has fewer than {SLOTS} free CPUs: {ray.available_resources()}"
    pg = placement_group([{"CPU": 1.0}] * spare) if spare else None
    if pg is not None:
        ray.get(pg.ready(), timeout=60)
    try:
        yield
    finally:
        if pg is not None:
            remove_placement_group(pg)


@pytest.mark.parametrize("stage", [1, 3])
def test_resize_while_the_replacement_starts(stage: int, four_slots: None) -> None:
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)) for _ in range(8)]
    opt = zr.SGD(lr=0.05, momentum=0.9)
    cfg = zr.ZeroConfig(stage=stage, world_size=3, bucket_bytes=4096, health_timeout_s=5.0,
                        elastic=zr.ElasticConfig(redundancy="peer", max_world_size=SLOTS),
                        stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)) if stage == 3
                        else zr.Stage3Config())
    with zr.ZeroTrainer(MLP_FN, mse_loss, optimizer=opt, config=cfg) as trainer:
        trainer.step(batches[0])
        trainer.step(batches[1])
        pid = ray.get(trainer.actors[1].node.remote(), timeout=30)["pid"]
        os.kill(pid, signal.SIGKILL)
        for b in batches[2:5]:  # the first of these finds the loss; the run goes on at 2
            trainer.step(b)
        assert [sorted(r.lost) for r in trainer.recoveries] == [[1]]  # the kill fired, and was survived
        # The regression's condition: the replacement started for the 3-owner run holds the
        # fourth slot but has not joined (its start, a Ray worker importing torch, takes seconds).
        assert trainer.world_size == 2 and any("replacements starting" in n for n in trainer.recoveries[0].notes)
        report = trainer.resize(4)
        assert (report["previous_world_size"], report["world_size"], trainer.world_size) == (2, 4, 4)
        for b in batches[5:]:
            trainer.step(b)
        assert trainer.world_size == 4  # nothing grew or shrank behind the resize
        got = trainer.full_state_dict()
    ref, _ = single_process(MLP_FN, mse_loss, opt, batches)
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= 1e-6
