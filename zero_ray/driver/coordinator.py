"""Coordinator: the driver's gRPC service for operators (status, checkpoint, stop, metrics).

It is handed what each call needs (the run's status snapshot, its stop request, its checkpoint
and resize) as functions, and never drives training itself: ``stop`` only raises a flag the
training loop observes. It watches the run as a ``Callback`` while a Metrics stream is open (it
adds itself to the run's ``Callbacks`` with the first and removes itself with the last, so a
step with no one watching does not call it): each step's metrics go to every open stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from zero_ray.control import handlers as h
from zero_ray.core.reply_combine import CombinedStep
from zero_ray.driver.callbacks import Callback, Callbacks
from zero_ray.driver.reports import ResizeReport, StepMetrics


class Coordinator(Callback):
    """Implements ``zero_ray.control.handlers.CoordinatorHandler`` over the run's calls:
    ``status(flight)`` (a snapshot, thread-safe), ``stop(reason)`` (the state afterwards),
    ``checkpoint(path or None)`` (directory and step of a save after the step in flight) and
    ``resize(world_size)``; ``watchers``: the run's callbacks, which it joins while a Metrics
    stream is open."""

    def __init__(self, *, status: Callable[[bool], h.JobStatus], stop: Callable[[str], str],
                 checkpoint: Callable[[str | None], tuple[str, int]], resize: Callable[[int], ResizeReport],
                 watchers: Callbacks) -> None:
        self._watchers = watchers
        self._status = status
        self._stop = stop
        self._checkpoint = checkpoint
        self._resize = resize
        self._lock = threading.Lock()
        self._subscribers: list[queue.Queue[h.MetricsEvent]] = []

    def on_step(self, metrics: StepMetrics, reply: CombinedStep) -> None:
        self.publish(h.MetricsEvent(step=int(metrics.step), loss=metrics.loss, step_seconds=metrics.step_seconds,
                                    tokens_per_second=metrics.items_per_second,
                                    values={"grad_norm": metrics.grad_norm, "lr": metrics.lr,
                                            "items": metrics.item_count}))

    def publish(self, event: h.MetricsEvent) -> None:
        """Fan one step's metrics out to every open Metrics stream (never blocks training)."""
        with self._lock:
            for q in self._subscribers:
                try:
                    q.put_nowait(event)
                except queue.Full:  # a slow reader loses events rather than stalling training
                    pass

    def status(self, flight: bool = False) -> h.JobStatus:
        return self._status(flight)

    def checkpoint(self, path: str | None) -> h.CheckpointResult:
        directory, step = self._checkpoint(path or None)
        return h.CheckpointResult(path=directory, step=step)

    def stop(self, reason: str) -> str:
        return self._stop(reason)

    def resize(self, world_size: int) -> h.ResizeResult:
        report = self._resize(world_size)
        return h.ResizeResult(previous_world_size=report.previous_world_size, world_size=report.world_size)

    def metrics(self, cancelled: threading.Event) -> Iterator[h.MetricsEvent]:
        q: queue.Queue[h.MetricsEvent] = queue.Queue(maxsize=1024)
        with self._lock:
            self._subscribers.append(q)
            if len(self._subscribers) == 1:  # the first stream: be told of steps from now on
                self._watchers.add(self)
        try:
            while not cancelled.is_set():
                try:
                    yield q.get(timeout=0.5)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                self._subscribers.remove(q)
                if not self._subscribers:
                    self._watchers.remove(self)
