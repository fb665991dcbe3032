"""Whether the cluster's nodes can hold a pool's owners, and how start-up waits until they can (pure).

A pool started on a cluster whose live nodes cannot hold its owners does not fail at once: the
owners are created first, and their pending requests for their slots are the demand Ray's
autoscaler (KubeRay's, the cluster launcher's) starts nodes for; a node joined by hand
(``ray start --address``) counts the same. Start-up waits up to ``ZeroConfig.capacity_timeout_s``,
logging what it waits for at most every ``REPORT_EVERY_S``; at the bound a ``ResourceError``
names what is missing, the bound and the fix. Room is counted from the nodes' totals, node by
node (an owner's slot is never split across nodes): slots other work holds count as room, and
waiting for those is the start-up timeout's job, as for an owner that is slow to start.

Pure: imports neither ray nor grpc nor torch; the driver passes in the nodes and the clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from zero_ray.errors import ResourceError

REPORT_EVERY_S = 30.0  # the waiting line is logged at once, then at most this often


def owners_fit(total: Mapping[str, float], demand: Mapping[str, float]) -> int:
    """How many owners asking for ``demand`` each one node with ``total`` resources can hold."""
    asked = {k: v for k, v in demand.items() if v > 0}
    if not asked:
        raise ResourceError(f"an owner's slot {dict(demand)} asks for nothing")
    return int(min(math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in asked.items()))


def _plain(resources: Mapping[str, float]) -> dict[str, float | int]:
    return {k: int(v) if float(v).is_integer() else v for k, v in resources.items()}


def _slots(count: int) -> str:
    return f"{count} more owner slot{'s' if count != 1 else ''}"


@dataclass(frozen=True, kw_only=True)
class Room:
    """What the live nodes can hold of a pool's owners, at one moment.

    owners: how many owners the pool needs in all.
    demand: one owner's slot (e.g. ``{"CPU": 1}``, or ``{"GPU": 1, "CPU": 1}`` on CUDA).
    holds: how many such owners the live nodes could hold in all, node by node.
    total / free: the cluster's totals and free amounts of the demanded resources.
    """

    owners: int
    demand: Mapping[str, float]
    holds: int
    total: Mapping[str, float] = field(default_factory=dict)
    free: Mapping[str, float] = field(default_factory=dict)

    @property
    def missing(self) -> int:
        """Owner slots the live nodes lack."""
        return max(0, self.owners - self.holds)

    def _facts(self) -> str:
        return (f"{self.owners} owners need {_plain(self.demand)} each; the cluster's live nodes hold {self.holds} "
                f"(they have {_plain(self.total)}, {_plain(self.free)} free)")

    def waiting(self, *, waited_s: float, bound_s: float) -> str:
        """The line logged while start-up waits."""
        return (f"waiting for {_slots(self.missing)}: {self._facts()}; {waited_s:.0f}s of up to "
                f"capacity_timeout_s={bound_s:g}s for nodes to join (an autoscaler starts them for the owners' "
                "pending requests; `ray start --address` joins one by hand)")

    def error(self, *, bound_s: float) -> ResourceError:
        """The error at the bound: what was missing, the bound, and the fix."""
        if "GPU" in self.demand:
            fix = (f"add GPU nodes with room for {self.missing} more owner(s), lower world_size, or use "
                   "device='cpu'")
        else:
            fix = (f"add nodes with room for {self.missing} more owner(s), lower world_size or num_cpus_per_owner, "
                   "or start Ray with more logical CPUs (ray.init(num_cpus=...))")
        return ResourceError(f"the cluster lacked {_slots(self.missing)} after waiting capacity_timeout_s="
                             f"{bound_s:g}s: {self._facts()}. Fix: {fix}; or raise capacity_timeout_s if an "
                             "autoscaler's nodes take longer to start")


def room(*, owners: int, demand: Mapping[str, float], nodes: Sequence[Mapping[str, float]],
         free: Mapping[str, float]) -> Room:
    """The ``Room`` for ``owners`` owners of ``demand`` on live nodes with these totals."""
    return Room(owners=owners, demand=dict(demand), holds=sum(owners_fit(n, demand) for n in nodes),
                total={k: sum(n.get(k, 0.0) for n in nodes) for k in demand},
                free={k: free.get(k, 0.0) for k in demand})


class Verdict(Enum):
    READY = "ready"  # the nodes hold every owner: stop waiting
    WAIT = "wait"  # keep waiting, nothing to log
    REPORT = "report"  # keep waiting, and log ``Room.waiting`` now


@dataclass(kw_only=True)
class CapacityWait:
    """Start-up's wait for room, one look at a time: ``check`` a fresh ``Room`` with the clock's
    reading; it says whether to stop, wait, or wait and log, and raises ``Room.error`` once
    ``bound_s`` has passed with room still missing (at once for a bound of 0)."""

    bound_s: float
    started_s: float
    report_every_s: float = REPORT_EVERY_S
    reported_s: float | None = None

    def check(self, current: Room, now_s: float) -> Verdict:
        if current.missing == 0:
            return Verdict.READY
        if now_s - self.started_s >= self.bound_s:
            raise current.error(bound_s=self.bound_s)
        if self.reported_s is None or now_s - self.reported_s >= self.report_every_s:
            self.reported_s = now_s
            return Verdict.REPORT
        return Verdict.WAIT
