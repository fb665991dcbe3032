"""HealthMonitor: one heartbeat stream per owner, all read on one background thread.

A rank is lost when its stream stalls for ``timeout_s`` (a frozen process, e.g. SIGSTOP) or
ends with an error (the actor or its node died; Ray closes the server with the process).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from zero_ray.control.client import OwnerClient
from zero_ray.control.handlers import Heartbeat
from zero_ray.control.heartbeats import HeartbeatReader
from zero_ray.control.rank_watch import LossListeners, RankWatch

log = logging.getLogger(__name__)


class HealthMonitor:
    """Watches every owner's Health stream (all of them on one thread: ``control/heartbeats.py``);
    ``lost()`` names the ranks that stopped answering. A ``RankHealthWatch``, as the relays'
    SubtreeHealthMonitor is."""

    def __init__(self, clients: list[OwnerClient], *, interval_s: float, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ranks = [RankWatch(rank=r) for r in range(len(clients))]
        self._listeners = LossListeners()
        self._reader = HeartbeatReader([c.config for c in clients], interval_s=interval_s, stall_s=timeout_s,
                                       on_beat=self._beat, on_lost=self._lose)

    def _beat(self, rank: int, beat: Heartbeat) -> None:
        now = time.time()
        with self._lock:
            self._ranks[rank] = dataclasses.replace(self._ranks[rank], last_beat=now, state=beat.state,
                                                    rss_bytes=beat.rss_bytes)

    def _lose(self, rank: int, reason: str) -> None:
        if self._stop.is_set():
            return
        with self._lock:
            self._ranks[rank] = dataclasses.replace(self._ranks[rank], lost_reason=reason)
        self._listeners.ring()
        log.error("rank %d lost: %s", rank, reason)

    def lost(self) -> dict[int, str]:
        """The ranks lost, and why."""
        with self._lock:
            return {h.rank: h.lost_reason for h in self._ranks if h.lost_reason is not None}

    def snapshot(self) -> list[RankWatch]:
        """Every rank's health, by rank."""
        with self._lock:
            return list(self._ranks)

    def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the reader's thread) each time a rank is lost."""
        self._listeners.add(wake)

    def unlisten(self, wake: Callable[[], None]) -> None:
        """Stop calling ``wake``."""
        self._listeners.discard(wake)

    def close(self) -> None:
        """End the streams; no loss is reported after this."""
        self._stop.set()
        self._reader.close()
