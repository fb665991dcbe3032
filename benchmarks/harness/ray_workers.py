"""The Ray worker processes a piece of work starts: the raylet's children, sampled as they come.

Ray ends idle workers beyond its soft limit (the CPU count) about a second after their tasks
finish, so a count taken only at the end would miss a storm; a worker takes far longer than the
20 ms between samples to start. Used by ``benchmarks.ray_blocks`` and the Ray Dataset tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SAMPLE_S = 0.02


def raylet() -> Any:
    """The raylet of the Ray this process started (``ray.init()`` of a local cluster)."""
    import psutil

    found = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    if len(found) != 1:
        raise RuntimeError(f"expected this process's one raylet, found {found}")
    return found[0]


@contextmanager
def workers_started() -> Iterator[set[int]]:
    """The pids of the worker processes that appear while the block runs, filled in when it ends."""
    parent = raylet()
    before = {p.pid for p in parent.children()}
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.update(p.pid for p in parent.children())
            stop.wait(SAMPLE_S)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    new: set[int] = set()
    try:
        yield new
    finally:
        stop.set()
        thread.join(timeout=5)
        new.update(seen - before)
