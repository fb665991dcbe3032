"""Admission and shutdown of a control server's long-lived streams (Health, Metrics)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class Streams:
    """Admission and shutdown of long-lived server streams.

    Each open stream holds a pool thread for its lifetime, so they are capped
    below the pool size. Each gets an event set when the call ends (the client
    cancelled, the deadline passed) or the server stops, which the stream waits
    on between messages instead of sleeping.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._open: set[threading.Event] = set()
        self._closed = False

    @contextmanager
    def open(self, context: grpc.ServicerContext, method: str) -> Iterator[threading.Event]:
        """Admit a stream or abort the call; yields its "finished" event."""
        finished = threading.Event()
        with self._lock:
            refusal = (
                (grpc.StatusCode.UNAVAILABLE, f"{method}: the server is shutting down") if self._closed else
                (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {self._limit} streams are open already "
                                                     f"(max_streams={self._limit}); close one first")
                if len(self._open) >= self._limit else None
            )
            if refusal is None:
                self._open.add(finished)
        if refusal is not None:
            context.abort(*refusal)
        if not context.add_callback(finished.set):  # the call has ended already
            finished.set()
        try:
            yield finished
        finally:
            with self._lock:
                self._open.discard(finished)

    def close(self) -> None:
        """End every open stream and refuse new ones."""
        with self._lock:
            self._closed = True
            for finished in self._open:
                finished.set()
