"""Surviving lost owners on real actors: an owner kills itself with ``ray.kill`` in the middle
of a step (deterministically: when its piece of the batch carries a marker), the driver detects
it, restores the lost partition (from peers' memory, or the last checkpoint), replays, and the
run ends exactly where the uninterrupted one does."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zero_ray as zr
from kill_helpers import kill_and_wait
from faults import fired_kills, kill_on_marker, planned_kills
from zero_ray.models import mlp
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MLP_FN = functools.partial(mlp, 16, 3)
UNITS = zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0))
STEPS = 6


def plain_mse(module: torch.nn.Module, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return F.mse_loss(module(batch[0]), batch[1])


def batches_with_kills(at: dict[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``at``: step index -> which sample row carries the marker (the owner whose piece starts
    with it dies)."""
    g = torch.Generator().manual_seed(3)
    out = [(torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)) for _ in range(STEPS)]
    for n, (step, row) in enumerate(sorted(at.items())):
        out[step][0][row, 0] = -101.0 - n
    return out


def config(stage: int, world_size: int, **kw) -> zr.ZeroConfig:  # type: ignore[no-untyped-def]
    return zr.ZeroConfig(stage=stage, world_size=world_size, bucket_bytes=4096, health_timeout_s=5.0,
                         collective_timeout_s=60.0,
                         stage3=UNITS if stage == 3 else zr.Stage3Config(), **kw)


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def run(batches, marks: Path, cfg: zr.ZeroConfig, *, save_at: int | None = None):  # type: ignore[no-untyped-def]
    opt = zr.SGD(lr=0.05, momentum=0.9)
    trainer = zr.ZeroTrainer(MLP_FN, functools.partial(kill_on_marker, marks=str(marks)), optimizer=opt, config=cfg)
    times = []
    try:
        for i, b in enumerate(batches):
            if save_at is not None and i == save_at:
                trainer.save_checkpoint(marks / "ckpt", wait=True)
            t0 = time.perf_counter()
            trainer.step(b)
            times.append(time.perf_counter() - t0)
        assert trainer.step_count == len(batches)
        assert fired_kills(str(marks)) == planned_kills(batches)  # each planned kill happened, once
        return trainer.full_state_dict(), trainer.recoveries, times, trainer.world_size
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_owner_killed_mid_step_is_restored_from_peer_memory(stage: int, tmp_path: Path) -> None:
    batches = batches_with_kills({3: 4})  # row 4 of 12 starts rank 1's piece at 3 ranks
    got, recoveries, times, world_size = run(batches, tmp_path, config(stage, 3, elastic=zr.ElasticConfig(redundancy="peer")))
    ref, _ = single_process(MLP_FN, plain_mse, zr.SGD(lr=0.05, momentum=0.9), batches)
    assert max_dev(got, ref) <= 1e-6
    (r,) = recoveries
    print(f"stage {stage}: {r.summary()}; step with the kill took {times[3]:.2f}s")
    # continued on the two survivors at once; the replacement joins once it is up (test_capacity)
    assert (r.source, sorted(r.lost), r.world_size_after) == ("peer", [1], 2)
    assert r.resume_step == 3 and r.replayed_steps == 1  # no committed step lost
    assert any("1 replacements starting" in n for n in r.notes) and world_size in (2, 3)


def test_restore_from_the_last_checkpoint_replays_the_steps_since(tmp_path: Path) -> None:
    batches = batches_with_kills({4: 0})
    got, recoveries, _, _ = run(batches, tmp_path, config(2, 2), save_at=2)
    ref, _ = single_process(MLP_FN, plain_mse, zr.SGD(lr=0.05, momentum=0.9), batches)
    assert max_dev(got, ref) <= 1e-6
    (r,) = recoveries
    assert (r.source, r.resume_step, r.replayed_steps) == ("checkpoint", 2, 3)


def test_two_failures_in_a_row(tmp_path: Path) -> None:
    # The first loss leaves two survivors, which go on alone (row 6 then starts rank 1's piece);
    # the second would leave one, holding the only copies: that restore waits for replacements.
    batches = batches_with_kills({2: 0, 3: 6})
    got, recoveries, _, _ = run(batches, tmp_path, config(1, 3, elastic=zr.ElasticConfig(redundancy="peer")))
    ref, _ = single_process(MLP_FN, plain_mse, zr.SGD(lr=0.05, momentum=0.9), batches)
    assert max_dev(got, ref) <= 1e-6
    assert [sorted(r.lost) for r in recoveries] == [[0], [1]]
    assert [r.world_size_after for r in recoveries] == [2, 3]


def test_failures_beyond_max_failures_end_with_a_clear_error(tmp_path: Path) -> None:
    batches = batches_with_kills({1: 0})
    cfg = config(2, 2, max_failures=0, elastic=zr.ElasticConfig(redundancy="peer"))
    trainer = zr.ZeroTrainer(MLP_FN, functools.partial(kill_on_marker, marks=str(tmp_path)), config=cfg)
    try:
        trainer.step(batches[0])
        with pytest.raises(zr.ZeroRayError, match=r"The run failed at step 2: 1 failures exceed self.max_failures=0"):
            trainer.step(batches[1])
        assert trainer.state.value == "failed"
        assert "max_failures=0" in trainer.recoveries[0].reason
        assert fired_kills(str(tmp_path)) == planned_kills(batches[:2]) == {0}
        with pytest.raises(zr.ZeroRayError, match="the trainer is failed"):
            trainer.step(batches[2])
    finally:
        trainer.shutdown()


def test_failure_during_a_resize_and_during_a_save_recover(tmp_path: Path) -> None:
    batches = batches_with_kills({})
    opt = zr.SGD(lr=0.05, momentum=0.9)
    trainer = zr.ZeroTrainer(MLP_FN, plain_mse, optimizer=opt,
                             config=config(2, 3, elastic=zr.ElasticConfig(redundancy="peer")))
    try:
        trainer.step(batches[0])
        trainer.step(batches[1])
        kill_and_wait(trainer.actors[2])
        with pytest.raises(zr.ResizeInterrupted, match="restored at 2 owners"):  # the survivors go on
            trainer.resize(4)
        trainer.step(batches[2])
        kill_and_wait(trainer.actors[0])
        saved = trainer.save_checkpoint(tmp_path, wait=True)  # finds the loss, recovers, saves step 3
        for b in batches[3:]:
            trainer.step(b)
        got = trainer.full_state_dict()
        assert [(r.call, sorted(r.lost)) for r in trainer.recoveries] == [("resizing to 4 owners", [2]),
                                                                          ("save_checkpoint", [0])]
        assert saved.endswith("step-00000003") and (tmp_path / "latest").exists()
    finally:
        trainer.shutdown()
    ref, _ = single_process(MLP_FN, plain_mse, opt, batches)
    assert max_dev(got, ref) <= 1e-6
