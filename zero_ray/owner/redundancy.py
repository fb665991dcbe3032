"""Peer snapshots: every owner keeps, in host memory, a copy of its own shard and of one
peer's (its "ward"), so a lost owner's partition can be rebuilt without storage.

A snapshot is taken at the end of a step (after the update) into *pending* buffers: the own
copy is a local clone, the ward's arrives by point-to-point from the ward while this rank sends
its own to its backup. Pending becomes current only once the driver has seen every rank finish
that step (it says so by sending the next step, or ``commit_upto`` during recovery), so a
failure in the middle of an exchange leaves every rank's current copies at one common step.
Host memory: up to four shard copies (own and ward, current and pending) of 4 bytes x (1 +
moments) per element, reported by ``nbytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zero_ray.collective.group import Collective
from zero_ray.owner.engine import OwnerEngine
from zero_ray.owner.host_copy import host_copies
from zero_ray.owner.param_group import OptimizerSlice
from zero_ray.owner.resize import run_p2p, slice_kinds


@dataclass(kw_only=True)
class Snapshot:
    """One rank's optimizer slices over its own shard ranges, as of driver step ``step``."""

    rank: int
    step: int
    world_size: int
    slices: list[OptimizerSlice]
    scalars: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.slices for t in (s.master, *s.moments.values()))


def _own_slices(engine: OwnerEngine, rank: int, *, clone: bool) -> list[OptimizerSlice]:
    """``rank``'s shard range of every bucket: cloned from this engine's state (``clone``), or
    zeroed buffers of the same shape to receive into."""
    out = []
    live = {s.bucket.index: s for s in engine.state.optimizer_slices()}
    for b in engine.layout.buckets:
        lo, hi = b.shard_range(rank)
        s = live[b.index]  # every rank has the same buckets, trainable or frozen alike
        if clone:
            names = list(s.moments)
            master, *rest = host_copies([s.master[lo - s.start:hi - s.start],
                                         *(s.moments[k][lo - s.start:hi - s.start] for k in names)],
                                        dtype=torch.float32)
            moments = dict(zip(names, rest))
        else:
            master = torch.zeros(hi - lo, dtype=torch.float32)
            moments = {k: torch.zeros(hi - lo, dtype=torch.float32) for k in s.moments}
        out.append(OptimizerSlice(bucket=b, start=lo, end=hi, master=master, moments=moments))
    return out


def _tensors(slices: list[OptimizerSlice]) -> list[torch.Tensor]:
    return [t for s in slices for t in (s.master, *s.moments.values())]


class PeerSnapshots:
    """This owner's current and pending own/ward snapshots."""

    def __init__(self) -> None:
        self.own: Snapshot | None = None
        self.ward: Snapshot | None = None
        self._pending: tuple[Snapshot, Snapshot | None] | None = None

    def take(self, engine: OwnerEngine, group: Collective, *, step: int, backup: int, ward: int,
             timeout_s: float) -> int:
        """Snapshot after driver step ``step``: clone own slices, send them to ``backup`` while
        receiving ``ward``'s. Returns bytes sent."""
        import torch.distributed as dist

        rank, n = engine.rank, engine.world_size
        slices = engine.state.optimizer_slices()
        scalars = {**engine.counters(),
                   # the layout facts a restore needs, so it needs no live engine
                   "buckets": [b.numel for b in engine.layout.buckets], "whole": engine.spec.plan.updates_whole_buffer,
                   "kinds": slice_kinds(slices)}
        own = Snapshot(rank=rank, step=step, world_size=n, slices=_own_slices(engine, rank, clone=True),
                       scalars=scalars)
        theirs = None
        sent = 0
        if backup != rank:
            theirs = Snapshot(rank=ward, step=step, world_size=n, slices=_own_slices(engine, ward, clone=False),
                              scalars=scalars)
            pg = getattr(group, "process_group", None)
            ops: list[object] = []
            for i, t in enumerate(_tensors(own.slices)):
                ops.append(dist.P2POp(dist.isend, t, backup, group=pg, tag=i))
                sent += t.numel() * 4
            for i, t in enumerate(_tensors(theirs.slices)):
                ops.append(dist.P2POp(dist.irecv, t, ward, group=pg, tag=i))
            run_p2p(ops, me=rank, pg=pg, timeout_s=timeout_s, what="peer snapshot")
        self._pending = (own, theirs)
        return sent

    def commit_upto(self, step: int) -> None:
        """Every rank finished driver step ``step``: a pending snapshot of it (or earlier) counts."""
        if self._pending is not None and self._pending[0].step <= step:
            self.own, self.ward = self._pending
            self._pending = None

    def drop_pending(self) -> None:
        self._pending = None

    def sources(self) -> dict[int, Snapshot]:
        """The committed snapshots held, by the rank they belong to."""
        return {s.rank: s for s in (self.own, self.ward) if s is not None}

    def info(self) -> dict[str, Any]:
        return {r: {"step": s.step, "world_size": s.world_size, "scalars": s.scalars} for r, s in self.sources().items()}

    @property
    def nbytes(self) -> int:
        held = [self.own, self.ward, *(self._pending or ())]
        return sum(s.nbytes for s in held if s is not None)
