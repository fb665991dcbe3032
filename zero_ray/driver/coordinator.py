"""Coordinator: the driver's gRPC service for operators (status, checkpoint, stop, metrics).

It reads the trainer's state through a small snapshot interface and never drives training
itself: ``stop`` only raises a flag the training loop observes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Protocol

from zero_ray.control import handlers as h
from zero_ray.driver.reports import ResizeReport


class RunView(Protocol):
    """What the coordinator needs to see of a run (ZeroTrainer provides it)."""

    def job_status(self) -> h.JobStatus: ...

    def request_stop(self, reason: str) -> str: ...

    def checkpoint_now(self, path: str | None) -> tuple[str, int]: ...

    def resize(self, world_size: int) -> ResizeReport: ...


class Coordinator:
    """Implements ``zero_ray.control.handlers.CoordinatorHandler`` over a RunView."""

    def __init__(self, run: RunView) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._subscribers: list[queue.Queue[h.MetricsEvent]] = []

    def publish(self, event: h.MetricsEvent) -> None:
        """Fan one step's metrics out to every open Metrics stream (never blocks training)."""
        with self._lock:
            for q in self._subscribers:
                try:
                    q.put_nowait(event)
                except queue.Full:  # a slow reader loses events rather than stalling training
                    pass

    def status(self, flight: bool = False) -> h.JobStatus:
        return self._run.job_status(flight=flight)

    def checkpoint(self, path: str | None) -> h.CheckpointResult:
        directory, step = self._run.checkpoint_now(path or None)
        return h.CheckpointResult(path=directory, step=step)

    def stop(self, reason: str) -> str:
        return self._run.request_stop(reason)

    def resize(self, world_size: int) -> h.ResizeResult:
        report = self._run.resize(world_size)
        return h.ResizeResult(previous_world_size=report.previous_world_size, world_size=report.world_size)

    def metrics(self, cancelled: threading.Event) -> Iterator[h.MetricsEvent]:
        q: queue.Queue[h.MetricsEvent] = queue.Queue(maxsize=1024)
        with self._lock:
            self._subscribers.append(q)
        try:
            while not cancelled.is_set():
                try:
                    yield q.get(timeout=0.5)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                self._subscribers.remove(q)
