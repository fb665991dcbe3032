"""An owner's flight recorder: its recent collectives and its current phase, readable from any
thread (the control server's, while the compute thread is blocked) at any time.

``RecordedGroup`` wraps the rank's world group: every collective issued through it, from the
compute thread or the communication thread, is recorded with its group's sequence number. The
engine sets the phase (``FlightRecorder.phase``). ``core/stall_diagnosis.diagnose`` reads the records.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.collective.collective_api import ByteCounters, Collective
from zero_ray.core.stall_diagnosis import IDLE

RING = 64  # collectives kept per rank: enough to see the last step's pattern, a few KB


@dataclass(frozen=True, slots=True)
class Event:
    """One collective as this process records it (it crosses to the driver as the control
    plane's ``CollectiveEvent`` record, field for field; ``core/stall_diagnosis`` reads either)."""

    op: str
    group: str
    seq: int
    nbytes: int
    started: float
    ended: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The recorder's state at one moment (``now``, this process's clock)."""

    phase: str
    phase_since: float
    now: float
    current: Event | None
    recent: tuple[Event, ...]


class FlightRecorder:
    """One rank's ring of recent collectives, the ones in flight, and its phase."""

    def __init__(self, ring: int = RING) -> None:
        self._lock = threading.Lock()
        self._recent: deque[Event] = deque(maxlen=ring)
        self._current: dict[int, Event] = {}  # by the issuing thread
        self._seq: dict[str, int] = {}
        self._phase, self._since = IDLE, time.time()

    def phase(self, name: str) -> None:
        """Enter a phase ("waiting for data", "forward", "backward", "update", "checkpoint", ...)."""
        with self._lock:
            if name != self._phase:
                self._phase, self._since = name, time.time()

    @contextmanager
    def collective(self, op: str, group: str, nbytes: int) -> Iterator[None]:
        """Record one collective for the duration of the block."""
        thread = threading.get_ident()
        with self._lock:
            seq = self._seq[group] = self._seq.get(group, 0) + 1
            event = self._current[thread] = Event(op=op, group=group, seq=seq, nbytes=nbytes,
                                                            started=time.time())
        try:
            yield
        finally:
            with self._lock:
                self._current.pop(thread, None)
                self._recent.append(Event(op=op, group=group, seq=seq, nbytes=nbytes,
                                                    started=event.started, ended=time.time()))

    def snapshot(self) -> Snapshot:
        """The record now: the oldest collective still in flight is the one the rank waits in."""
        with self._lock:
            current = min(self._current.values(), key=lambda e: e.started, default=None)
            return Snapshot(phase=self._phase, phase_since=self._since, now=time.time(), current=current,
                            recent=tuple(self._recent))


def _nbytes(*tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class RecordedGroup:
    """A ``Collective`` that records each of its operations in a ``FlightRecorder`` and does
    them on ``inner``; anything else (counters, the process group, abort) is ``inner``'s."""

    def __init__(self, inner: Collective, recorder: FlightRecorder, *, name: str) -> None:
        self.inner = inner
        self.recorder = recorder
        self.name = name

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def counters(self) -> ByteCounters:
        return self.inner.counters

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        with self.recorder.collective(op, self.name, _nbytes(buf)):
            return self.inner.reduce_scatter_(buf, op=op)

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        with self.recorder.collective(op, self.name, _nbytes(buf)):
            self.inner.all_gather_(buf, op=op)

    def all_reduce_(self, buf: torch.Tensor) -> None:
        with self.recorder.collective("all_reduce", self.name, _nbytes(buf)):
            self.inner.all_reduce_(buf)

    def all_reduce_values(self, values: list[float]) -> list[float]:
        with self.recorder.collective("all_reduce_values", self.name, 8 * len(values)):
            return self.inner.all_reduce_values(values)

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        with self.recorder.collective(op, self.name, _nbytes(*(t for t, _ in sends))):
            self.inner.send_recv(sends, recvs, op=op)

    def barrier(self) -> None:
        with self.recorder.collective("barrier", self.name, 0):
            self.inner.barrier()

    def destroy(self) -> None:
        self.inner.destroy()

    def abort(self) -> None:
        self.inner.abort()

    def __getattr__(self, name: str) -> Any:  # the backend's own extras (process_group, group_name)
        return getattr(self.inner, name)
