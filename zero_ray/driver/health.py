"""HealthMonitor: one heartbeat stream per owner, all read on one background thread.

A rank is lost when its stream stalls for ``timeout_s`` (a frozen process, e.g. SIGSTOP) or
ends with an error (the actor or its node died; Ray closes the server with the process).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from zero_ray.control.heartbeats import HeartbeatReader
from zero_ray.control.client import OwnerClient
from zero_ray.control.handlers import Heartbeat

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RankHealth:
    rank: int
    last_beat: float = 0.0
    state: str = "starting"
    rss_bytes: int = 0
    lost_reason: str | None = None

    @property
    def healthy(self) -> bool:
        return self.lost_reason is None


class HealthMonitor:
    """Watches every owner's Health stream (all of them on one thread: ``control/heartbeats.py``);
    ``lost()`` names the ranks that stopped answering."""

    def __init__(self, clients: list[OwnerClient], *, interval_s: float, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ranks = [RankHealth(rank=r) for r in range(len(clients))]
        self._reader = HeartbeatReader([c.config for c in clients], interval_s=interval_s, stall_s=timeout_s,
                                       on_beat=self._beat, on_lost=self._lose)

    def _beat(self, rank: int, beat: Heartbeat) -> None:
        health = self.ranks[rank]
        with self._lock:
            health.last_beat, health.state, health.rss_bytes = time.time(), beat.state, beat.rss_bytes

    def _lose(self, rank: int, reason: str) -> None:
        if self._stop.is_set():
            return
        with self._lock:
            self.ranks[rank].lost_reason = reason
        log.error("rank %d lost: %s", rank, reason)

    def lost(self) -> dict[int, str]:
        with self._lock:
            return {h.rank: h.lost_reason for h in self.ranks if h.lost_reason is not None}

    def snapshot(self) -> list[RankHealth]:
        with self._lock:
            return [RankHealth(**vars(h)) for h in self.ranks]

    def close(self) -> None:
        self._stop.set()
        self._reader.close()
