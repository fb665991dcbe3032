"""A failed point-to-point round must not keep its gloo works alive: a work holds its group's
sockets open, and the error's traceback keeps the failing frame (and so its locals) for as long
as anyone holds the error. A survivor whose collective failed would then keep its aborted group
open, and a peer blocked on it would wait out collective_timeout_s instead of failing at once
(measured in ``benchmarks.recovery_time`` at 4 owners: a third owner dropped as stuck after
settle_timeout_s, 11.0 s from kill to next step; 3.95 s with the works released). Pure: fake
works, no Ray, milliseconds."""

from __future__ import annotations

import datetime
import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zero_ray.collective.collective_api import ByteCounters
from zero_ray.collective.ray_group import RingGroup
from zero_ray.errors import CollectiveError
from zero_ray.owner.resilience import resize


def _closed(timeout: datetime.timedelta) -> bool:
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1438")


def _done(timeout: datetime.timedelta) -> bool:
    return True


class _Work:
    """A gloo work's wait is C++: no Python frame of it holds the work, so neither does this."""

    def __init__(self, fails: bool) -> None:
        self.wait = _closed if fails else _done


class _Dist:
    """Posts fake works (the receive from ``dead`` fails) and keeps a weak reference to each."""

    def __init__(self, dead: int) -> None:
        self.dead = dead
        self.posted: list[weakref.ref[_Work]] = []

    def _post(self, peer: int) -> _Work:
        work = _Work(fails=peer == self.dead)
        self.posted.append(weakref.ref(work))
        return work

    def isend(self, t: torch.Tensor, peer: int, group: Any) -> _Work:
        return self._post(-1)

    def irecv(self, t: torch.Tensor, peer: int, group: Any) -> _Work:
        return self._post(peer)

    def batch_isend_irecv(self, ops: list[Any]) -> list[_Work]:
        return [self._post(op.peer) for op in ops]


def _ring(rank: int, world_size: int, dist: _Dist) -> RingGroup:
    ring = RingGroup.__new__(RingGroup)  # without ray.util.collective: only _round is exercised
    ring._dist, ring.rank, ring.world_size, ring.counters = dist, rank, world_size, ByteCounters()
    ring._timeout, ring._pg, ring._scratch = datetime.timedelta(seconds=1), object(), {}
    ring._next, ring._prev = (rank + 1) % world_size, (rank - 1) % world_size
    return ring


def test_a_failed_ring_round_drops_its_works_while_the_error_is_held() -> None:
    dist = _Dist(dead=1)
    ring = _ring(2, 4, dist)
    with pytest.raises(CollectiveError, match="Connection closed") as caught:
        ring._round("reduce_scatter", [(torch.zeros(2), 3), (torch.zeros(2), 0)],
                    [(torch.zeros(2), 1), (torch.zeros(2), 0)])
    gc.disable()  # the point is that no collection is needed
    try:
        assert caught.value.__traceback__ is not None  # the error, and its frames, are still held
        assert len(dist.posted) == 4 and [w() for w in dist.posted] == [None] * 4
    finally:
        gc.enable()


def test_a_failed_transfer_drops_its_works_while_the_error_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as torch_dist

    dist = _Dist(dead=1)
    monkeypatch.setattr(torch_dist, "batch_isend_irecv", dist.batch_isend_irecv)
    ops = [SimpleNamespace(peer=p) for p in (0, 1, 3)]
    with pytest.raises(CollectiveError, match="resharding transfer on actor 2 failed") as caught:
        resize.run_p2p(ops, me=2, pg=object(), timeout_s=1.0, what="resharding transfer")
    gc.disable()
    try:
        assert caught.value.__traceback__ is not None
        assert len(dist.posted) == 3 and [w() for w in dist.posted] == [None] * 3
    finally:
        gc.enable()
