"""CommStream without Ray: order, failure reporting, cancellation."""

from __future__ import annotations

import threading
import time

import pytest

from zero_ray.collective.collective_api import SoloGroup
from zero_ray.collective.stream import CommStream


class _TwoRanks(SoloGroup):
    """World size 2, so that the stream runs its own thread (nothing is ever sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size = 2


def test_jobs_run_in_order_on_the_stream_thread() -> None:
    stream = CommStream(_TwoRanks(), name="test-comm")
    seen: list[tuple[int, str]] = []
    for i in range(5):
        stream.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    stream.drain()
    assert seen == [(i, "test-comm") for i in range(5)]
    stream.close()


def test_a_failure_is_reported_by_drain_even_after_later_submissions() -> None:
    stream = CommStream(_TwoRanks())
    stream.submit(lambda: 1 / 0)
    time.sleep(0.05)  # the failed job is done before the next one is submitted
    stream.submit(lambda: None)
    with pytest.raises(ZeroDivisionError):
        stream.drain()
    stream.drain()  # reported once
    stream.close()


def test_jobs_queued_after_a_failure_are_not_run_and_fail_with_its_error() -> None:
    stream = CommStream(_TwoRanks())
    release = threading.Event()
    ran: list[int] = []

    def fail() -> None:
        release.wait(5)
        raise RuntimeError("peer lost")

    stream.submit(fail)
    later = [stream.submit(lambda i=i: ran.append(i)) for i in range(3)]
    threading.Timer(0.1, release.set).start()
    with pytest.raises(RuntimeError, match="peer lost"):
        stream.drain()
    assert ran == []  # not run after the failure
    assert all("peer lost" in str(f.exception()) for f in later)
    stream.submit(lambda: ran.append(9)).result(timeout=5)  # usable again once drained
    assert ran == [9]
    stream.close()


def test_cancel_waits_for_the_running_job_and_skips_the_rest() -> None:
    stream = CommStream(_TwoRanks())
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> None:
        started.set()
        release.wait(5)
        ran.append("running")

    stream.submit(running)
    stream.submit(lambda: ran.append("queued"))
    started.wait(5)
    threading.Timer(0.1, release.set).start()
    stream.cancel()
    assert ran == ["running"]
    stream.close()
