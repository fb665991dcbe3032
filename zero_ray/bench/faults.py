"""Fault injection for the recovery tests and benchmark: an owner that kills itself mid-step
(``kill_on_marker``), and runs whose owner's process is SIGKILLed at a chosen point of the run's
life or SIGSTOPped (``run_with_kill``, through ``zero_ray.owner.faults``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.nn.functional as F

from zero_ray.owner.faults import ENV, Fault, killed_at, plan


def kill_on_marker(module: torch.nn.Module, batch: Any, *, marks: str) -> torch.Tensor:
    """MSE loss; an owner whose piece's first sample starts with a marker value (-101, -102, ...)
    kills itself with ``ray.kill`` once (a file in ``marks`` records that it did, so the replayed
    step goes through)."""
    x, y = batch
    value = float(x[0, 0]) if x.shape[0] else 0.0
    if value < -100:
        try:
            os.close(os.open(os.path.join(marks, f"killed{int(-value)}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            threading.Event().wait(60)  # ray.kill is asynchronous: stay in this step until it lands
    return F.mse_loss(module(x), y)


# -- owners killed (SIGKILL) or frozen (SIGSTOP) at chosen points of a run ----------------------------
KILL_POINTS = ("backward", "resize_transfer", "restore_after_loss", "peer_snapshot", "checkpoint_save", "freeze")


@dataclass(kw_only=True)
class KillRun:
    """What a run with a planned kill saw."""

    point: str
    params: dict[str, torch.Tensor]
    recoveries: list[Any]
    killed_at: float  # Unix time of the (first) kill
    kill_to_next_step_s: float  # to the first step completed after it
    world_sizes: list[int]
    notes: list[str] = field(default_factory=list)


def _faults(point: str, marks: str, at: int) -> list[Fault]:
    if point == "restore_after_loss":  # a first loss in backward, then the replacement dies in the restore
        return [Fault(point="backward", rank=1, after=at, dir=marks),
                Fault(point="restore_transfer", rank=2, after=0, dir=marks)]
    if point == "freeze":
        return []
    return [Fault(point=point, rank=1, after=at, dir=marks)]


def run_with_kill(point: str, *, model_fn: Any, loss_fn: Any, optimizer: Any, batches: list[Any],
                  config: Any, at: int, marks: str) -> KillRun:
    """Train on ``batches`` with ``config`` (3 owners or more, peer redundancy) while rank 1's
    process is SIGKILLed at ``point`` once ``at`` steps are done (``freeze``: SIGSTOPped before
    step ``at``); before step ``at`` the run resizes to one owner fewer (``resize_transfer``) or
    saves a checkpoint (``checkpoint_save``), as those kills need."""
    import zero_ray as zr
    from zero_ray.errors import ResizeInterrupted, ZeroRayError

    if point not in KILL_POINTS:
        raise ValueError(f"point={point!r} is not one of {KILL_POINTS}")
    previous = os.environ.get(ENV)
    os.environ[ENV] = plan(*_faults(point, marks, at))
    try:
        trainer = zr.ZeroTrainer(model_fn, loss_fn, optimizer=optimizer, config=config)
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
    done_at: list[float] = []
    sizes: list[int] = []
    notes: list[str] = []
    frozen_at = None
    try:
        for k, batch in enumerate(batches):
            if k == at and point == "resize_transfer":
                try:
                    trainer.resize(trainer.world_size - 1)
                except ResizeInterrupted as err:
                    notes.append(str(err).splitlines()[0])
            if k == at and point == "checkpoint_save":
                try:
                    trainer.save_checkpoint(wait=True)
                except ZeroRayError as err:  # abandoned, naming the lost owner
                    notes.append(str(err).splitlines()[0])
            if k == at and point == "freeze":
                pid = ray.get(trainer.actors[1].node.remote(), timeout=60)["pid"]
                os.kill(pid, signal.SIGSTOP)
                frozen_at = time.time()
            trainer.step(batch)
            done_at.append(time.time())
            sizes.append(trainer.world_size)
        params = trainer.full_state_dict()
        recoveries = list(trainer.recoveries)
    finally:
        trainer.shutdown()
    first = "backward" if point == "restore_after_loss" else point
    killed = frozen_at if point == "freeze" else killed_at(marks, first)
    if killed is None:
        raise AssertionError(f"the planned kill at {first} never happened")
    if point == "restore_after_loss" and killed_at(marks, "restore_transfer") is None:
        raise AssertionError("the second kill (in the restore) never happened")
    next_step = min(t for t in done_at if t > killed)
    return KillRun(point=point, params=params, recoveries=recoveries, killed_at=killed,
                   kill_to_next_step_s=next_step - killed, world_sizes=sizes, notes=notes)
