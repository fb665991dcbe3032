"""Flight records: where each owner is, and which one a stalled step waits for (pure).

Every owner keeps a ring of its recent collectives (operation, group, sequence number, bytes,
start and end) and its current phase (waiting for data, forward, backward, update, checkpoint),
as PyTorch's NCCL flight recorder does. When a step stalls, the driver gathers every rank's
``Flight`` and ``diagnose`` names the rank that diverged: the one not in the collective the
others wait in. A rank waiting on a stuck peer is never blamed for it.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

IDLE = "idle"


class CollectiveEvent(Protocol):
    """One collective on one rank (the ``CollectiveEvent`` record): ``seq`` counts the
    collectives this rank issued on ``group`` (every rank issues a group's in the same order, so
    equal ``(group, seq)`` on two ranks is the same collective); ``started`` / ``ended`` are Unix
    times on the rank's clock (``ended`` None while it runs)."""

    @property
    def op(self) -> str: ...
    @property
    def group(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def started(self) -> float: ...
    @property
    def ended(self) -> float | None: ...


class Flight(Protocol):
    """A rank's flight record as it answered (the ``Flight`` record): its phase and since
    when, the collective it is in (None between collectives), its recent ones (oldest first),
    and its clock (``now``), so that durations need no synchronised clocks."""

    @property
    def rank(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def phase_since(self) -> float: ...
    @property
    def now(self) -> float: ...
    @property
    def current(self) -> CollectiveEvent | None: ...
    @property
    def recent(self) -> Sequence[CollectiveEvent]: ...


def describe(event: CollectiveEvent) -> str:
    return f"{event.op} #{event.seq} on {event.group}"


def _events(flight: Flight) -> list[CollectiveEvent]:
    return [*flight.recent, *([flight.current] if flight.current is not None else [])]


def frontier(flight: Flight, group: str) -> int:
    """The last collective of ``group`` the rank reached (0: none in its ring)."""
    return max((e.seq for e in _events(flight) if e.group == group), default=0)


def where(flight: Flight) -> str:
    """Where a rank is, in words, with how long it has been there."""
    if flight.current is not None:
        waited = max(0.0, flight.now - flight.current.started)
        return (f"waiting in {describe(flight.current)} ({flight.current.nbytes} bytes) for {waited:.1f}s, "
                f"in {flight.phase}")
    last = flight.recent[-1] if flight.recent else None
    after = f"; its last collective was {describe(last)}" if last is not None else ""
    return f"in {flight.phase} for {max(0.0, flight.now - flight.phase_since):.1f}s, in no collective{after}"


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """Which ranks a stall waits for (``stuck``: in no collective, behind the one the others
    wait in), which wait (``waiting``), the collective they wait in, and one line per rank."""

    stuck: tuple[int, ...]
    waiting: tuple[int, ...]
    collective: CollectiveEvent | None
    lines: tuple[str, ...] = field(default=())

    def text(self) -> str:
        head = (f"rank(s) {list(self.stuck)} diverged: not in {describe(self.collective)}, which ranks "
                f"{list(self.waiting)} wait in" if self.stuck and self.collective is not None
                else "no rank diverged from the others")
        return head + "\n" + "\n".join(self.lines)


def diagnose(flights: Sequence[Flight], *, unreachable: Sequence[int] = ()) -> Diagnosis:
    """Name the ranks a stalled step waits for. On the group of the latest collective any rank
    began, the furthest collective reached is the one the step is stuck at; the ranks that
    reached it wait (in it, or timed out in it). A rank behind it that is in no collective and
    not idle diverged: in compute, waiting for data, or blocked in user code. An idle rank
    behind it ended its step with an error of its own and is not blamed. ``unreachable``: ranks
    that did not answer (listed; the liveness check decides about them)."""
    ordered = sorted(flights, key=lambda f: f.rank)
    lines = tuple([f"rank {f.rank}: {where(f)}" for f in ordered] + [f"rank {r}: did not answer" for r in
                                                                      sorted(unreachable)])
    events = [e for f in flights for e in _events(f)]
    if not events:
        return Diagnosis(stuck=(), waiting=(), collective=None, lines=lines)
    group = max(events, key=lambda e: e.started).group
    reached = {f.rank: frontier(f, group) for f in flights}
    at = max(reached.values())
    reference = next(e for e in events if e.group == group and e.seq == at)
    waiting = tuple(f.rank for f in ordered if reached[f.rank] == at)
    stuck = tuple(f.rank for f in ordered
                  if reached[f.rank] < at and f.current is None and f.phase != IDLE)
    return Diagnosis(stuck=stuck, waiting=waiting, collective=reference, lines=lines)
