"""HealthMonitor: one heartbeat stream per owner, watched on background threads.

A rank is lost when its stream stalls for ``timeout_s`` (a frozen process, e.g. SIGSTOP) or
ends with an error (the actor or its node died; Ray closes the server with the process).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from zero_ray.control.client import OwnerClient
from zero_ray.errors import ControlError

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
    """Watches every owner's Health stream; ``lost()`` names the ranks that stopped answering."""

    def __init__(self, clients: list[OwnerClient], *, interval_s: float, timeout_s: float) -> None:
        self._clients = clients
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ranks = [RankHealth(rank=r) for r in range(len(clients))]
        self._threads = [threading.Thread(target=self._watch, args=(r,), daemon=True, name=f"zero_ray-health-{r}")
                         for r in range(len(clients))]
        for t in self._threads:
            t.start()

    def _watch(self, rank: int) -> None:
        health = self.ranks[rank]
        try:
            with self._clients[rank].heartbeats(self._interval_s, stall_s=self._timeout_s) as stream:
                for beat in stream:
                    with self._lock:
                        health.last_beat, health.state, health.rss_bytes = time.time(), beat.state, beat.rss_bytes
                    if self._stop.is_set():
                        return
        except ControlError as err:
            if not self._stop.is_set():
                with self._lock:
                    health.lost_reason = str(err)
                log.error("rank %d lost: %s", rank, err)
            return
        if not self._stop.is_set():
            with self._lock:
                health.lost_reason = "its heartbeat stream ended"

    def lost(self) -> dict[int, str]:
        with self._lock:
            return {h.rank: h.lost_reason for h in self.ranks if h.lost_reason is not None}

    def snapshot(self) -> list[RankHealth]:
        with self._lock:
            return [RankHealth(**vars(h)) for h in self.ranks]

    def close(self) -> None:
        self._stop.set()
