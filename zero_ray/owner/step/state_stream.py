"""StateStream: the helper thread of an update whose state is offloaded (``Offload``).

The update steps one parameter group at a time (``ShardOptimizer``). While the owner's thread
steps a group, this one thread brings the next group's offloaded state in (its pages read and
mapped, then checked against their block hashes) and puts the previous group's back (new
hashes, pages handed to the kernel to write out). Its jobs run in the order given, so a group's
put-back ends before the following group's bring-in starts: about two groups are resident at once.

The first groups' bring-ins can start before the update, while the step's forward and backward
run (``read_ahead``: ``READ_AHEAD_GROUPS`` of them), so that the update does not open by waiting
for the disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from zero_ray.owner.step.param_group import ParamGroup

READ_AHEAD_GROUPS = 1  # brought in while the step computes (2 measured no faster from a cold disk: 1.30x vs 1.32x)


@dataclass
class StreamTimes:
    """Where the last streamed update's time went, in seconds. On the stepping thread: waiting
    for a group's state to be read and checked (``wait``), the optimizers' own steps, and at the
    end waiting for the last groups to be put back (``drain``). On the helper thread, overlapping
    those (and, for the first group, the step's forward and backward): reading the state in
    (``read``), checking its checksums (``verify``), recording the new ones (``seal``) and
    handing the pages back to the kernel, which writes them out on its own (``evict``)."""

    wait_s: float = 0.0
    step_s: float = 0.0
    drain_s: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0
    seal_s: float = 0.0
    evict_s: float = 0.0


class StateStream:
    """One rank's helper thread for streamed updates, and the first group read ahead of one."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.times = StreamTimes()  # the last update's (benchmarks.offload reads it)
        self._io: ThreadPoolExecutor | None = None
        self._early: list[tuple[ParamGroup, Future[None]]] = []  # read ahead of the next update

    def _helper(self) -> ThreadPoolExecutor:
        if self._io is None:  # one worker: its jobs run in the order given
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zero_ray-state-rank{self.rank}")
        return self._io

    def _bring_in(self, group: ParamGroup, times: StreamTimes) -> None:
        t0 = time.perf_counter()
        group.populate_state()
        t1 = time.perf_counter()
        group.verify_state()  # the disk gave back what the last update wrote, or the step stops
        times.read_s += t1 - t0
        times.verify_s += time.perf_counter() - t1

    def _put_back(self, group: ParamGroup, times: StreamTimes) -> None:
        t0 = time.perf_counter()
        group.seal_state()
        t1 = time.perf_counter()
        group.evict_state()
        times.seal_s += t1 - t0
        times.evict_s += time.perf_counter() - t1

    def read_ahead(self, order: Sequence[ParamGroup]) -> None:
        """Start bringing the next update's first groups (of ``order``) in now (a no-op if
        already started)."""
        if not self._early:
            self.times = StreamTimes()
            self._early = [(g, self._helper().submit(self._bring_in, g, self.times))
                           for g in order[:READ_AHEAD_GROUPS]]

    def forget(self) -> None:
        """Drop a read-ahead (before a restore replaces the state it read), once it has ended."""
        early, self._early = self._early, []
        wait([f for _, f in early])

    def run(self, order: Sequence[ParamGroup], step_group: Callable[[ParamGroup], None]) -> None:
        """Call ``step_group`` on each group of ``order`` with its state brought in, bringing the
        next one in and putting the last one back meanwhile. Returns once every job has ended;
        an error in bringing a group in is raised before that group steps."""
        early = {id(g): f for g, f in self._early}
        times = self.times if early else StreamTimes()
        self.times, self._early = times, []
        io = self._helper()
        jobs: list[Future[None]] = list(early.values())

        def bring_in(group: ParamGroup) -> Future[None]:
            ready = early.pop(id(group), None)
            if ready is None:
                jobs.append(ready := io.submit(self._bring_in, group, times))
            return ready

        try:
            ready = bring_in(order[0]) if order else None
            for k, group in enumerate(order):
                following = bring_in(order[k + 1]) if k + 1 < len(order) else None
                t0 = time.perf_counter()
                assert ready is not None
                ready.result()
                t1 = time.perf_counter()
                step_group(group)
                times.wait_s += t1 - t0
                times.step_s += time.perf_counter() - t1
                jobs.append(io.submit(self._put_back, group, times))
                ready = following
        finally:
            t0 = time.perf_counter()
            wait(jobs)  # every job ends before the update returns, an error too
            times.drain_s = time.perf_counter() - t0
