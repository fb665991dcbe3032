"""What the caller knows of every rank's health through the relay tree: a
:class:`SubtreeHealthMonitor` is the driver's ``HealthMonitor`` (driver/health.py) built over
relays instead of owners (issue 44, "health per node"), answering ``lost()`` and ``snapshot()``
per rank as it does.

It reads its children's streams with a :class:`SubtreeReader` (control/subtree_watch.py) and keeps
per rank the last beat's time (this process's clock, as HealthMonitor's), state and rss_bytes. A
rank is ``lost()`` when it itself is (its stream failed, ended or stalled, or it hosted a relay
that was lost); a rank under a lost relay is ``unwatched()`` instead, with a reason starting
"relay lost", and stays healthy in ``snapshot()``: its own state is unknown, and the loss of the
relay's host that came with it is what sets recovery going, which re-plans the tree and watches
the rank again. Losses are logged as HealthMonitor logs them; nothing is reported after close().
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from zero_ray.control.handlers import Heartbeat
from zero_ray.control.relay_hop import HopChild
from zero_ray.control.subtree_watch import SubtreeReader

__all__ = ["LossListeners", "RankHealthWatch", "RankWatch", "SubtreeHealthMonitor"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankWatch:
    """A rank's health as a monitor last knew it (``HealthMonitor``'s or, through relays,
    ``SubtreeHealthMonitor``'s, which also says why a rank under a lost relay is no longer
    watched)."""

    rank: int
    last_beat: float = 0.0
    state: str = "starting"
    rss_bytes: int = 0
    lost_reason: str | None = None
    unwatched_reason: str | None = None

    @property
    def healthy(self) -> bool:
        """Not lost itself (an unwatched rank is not known to be lost)."""
        return self.lost_reason is None


class LossListeners:
    """Who a monitor wakes the moment it loses a rank: a fan-out's wait blocks on its replies and
    would otherwise see the loss only at its next look (``POLL_S``), which was most of a loss's
    decision time. Nothing runs on the happy path: a wake is called only on a loss."""

    _lock: threading.Lock
    _wakes: list[Callable[[], None]]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes = []

    def add(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` on every loss from now on (on the monitor's thread: it must not block)."""
        with self._lock:
            self._wakes.append(wake)

    def discard(self, wake: Callable[[], None]) -> None:
        """Stop calling ``wake`` (nothing when it is not listening)."""
        with self._lock:
            if wake in self._wakes:
                self._wakes.remove(wake)

    def ring(self) -> None:
        """Wake every listener: a rank was just lost."""
        with self._lock:
            wakes = list(self._wakes)
        for wake in wakes:
            try:
                wake()
            except Exception:  # a listener's failure must not stop the monitor's reader
                log.exception("a loss listener failed")


class RankHealthWatch(Protocol):
    """What the driver asks of its health monitor, whether it reads every owner's stream
    (driver/health.HealthMonitor) or the top relays' (SubtreeHealthMonitor)."""

    def lost(self) -> dict[int, str]:
        """The ranks lost, and why."""
        ...

    def snapshot(self) -> list[RankWatch]:
        """Every watched rank's health, by rank."""
        ...

    def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the monitor's thread, so it must not block) each time a rank is lost."""
        ...

    def unlisten(self, wake: Callable[[], None]) -> None:
        """Stop calling ``wake``."""
        ...

    def close(self) -> None:
        """End the streams; no loss is reported after this."""
        ...


class SubtreeHealthMonitor:
    """Watches every rank under ``children`` (top or node relays, or owners) through their
    streams on one thread; ``lost()`` names the ranks that stopped answering."""

    _lock: threading.Lock
    _closed: threading.Event
    _ranks: dict[int, RankWatch]
    _listeners: LossListeners
    _reader: SubtreeReader

    def __init__(self, children: Sequence[HopChild], *, interval_s: float, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ranks = {r: RankWatch(rank=r) for c in children for r in c.ranks}
        self._listeners = LossListeners()
        self._reader = SubtreeReader(children, interval_s=interval_s, stall_s=timeout_s, on_beat=self._beat,
                                     on_lost=self._lose, on_unwatched=self._unwatch)

    def _beat(self, rank: int, beat: Heartbeat) -> None:
        self._set(rank, last_beat=time.time(), state=beat.state, rss_bytes=beat.rss_bytes)

    def _lose(self, rank: int, reason: str) -> None:
        if not self._closed.is_set():
            self._set(rank, lost_reason=reason, unwatched_reason=None)
            self._listeners.ring()
            log.error("rank %d lost: %s", rank, reason)

    def _unwatch(self, rank: int, reason: str) -> None:
        if not self._closed.is_set():
            self._set(rank, lost_reason=None, unwatched_reason=reason)
            log.warning("rank %d no longer watched: %s", rank, reason)

    def _set(self, rank: int, **changes: object) -> None:
        with self._lock:
            self._ranks[rank] = dataclasses.replace(self._ranks[rank], **changes)  # type: ignore[arg-type]

    def lost(self) -> dict[int, str]:
        """The ranks lost themselves, and why."""
        with self._lock:
            return {r: h.lost_reason for r, h in self._ranks.items() if h.lost_reason is not None}

    def unwatched(self) -> dict[int, str]:
        """The ranks under a lost relay (not lost themselves, as far as is known), and why."""
        with self._lock:
            return {r: h.unwatched_reason for r, h in self._ranks.items() if h.unwatched_reason is not None}

    def snapshot(self) -> list[RankWatch]:
        """Every watched rank's health, by rank."""
        with self._lock:
            return [self._ranks[r] for r in sorted(self._ranks)]

    def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the reader's thread) each time a rank is lost."""
        self._listeners.add(wake)

    def unlisten(self, wake: Callable[[], None]) -> None:
        """Stop calling ``wake``."""
        self._listeners.discard(wake)

    def close(self) -> None:
        """End the streams; no loss is reported after this."""
        self._closed.set()
        self._reader.close()

