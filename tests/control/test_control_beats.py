"""Every owner's heartbeats read on one thread (control/heartbeats.py): beats arrive, a silent
stream is lost after its stall bound, a stopped server is lost, close() reports nothing, and
readers closed one after another leave gRPC nothing to print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from control_fakes import WAIT_S, Served

from zero_ray.control.heartbeats import HeartbeatReader
from zero_ray.control.handlers import Heartbeat

READERS = 50  # before the fix, 4 runs of this test in 5 printed tracebacks from some of the closes


class _Seen:
    def __init__(self) -> None:
        self.beats: list[tuple[int, Heartbeat]] = []
        self.lost: dict[int, str] = {}
        self.changed = threading.Condition()

    def beat(self, rank: int, beat: Heartbeat) -> None:
        with self.changed:
            self.beats.append((rank, beat))
            self.changed.notify_all()

    def lose(self, rank: int, reason: str) -> None:
        with self.changed:
            self.lost[rank] = reason
            self.changed.notify_all()

    def wait_for(self, predicate) -> bool:  # type: ignore[no-untyped-def]
        with self.changed:
            return self.changed.wait_for(predicate, timeout=WAIT_S)


def test_beats_arrive_and_close_reports_no_loss(owner: Served) -> None:
    seen = _Seen()
    threads = threading.active_count()
    reader = HeartbeatReader([owner.client.config] * 2, interval_s=0.02, stall_s=5.0, on_beat=seen.beat,
                             on_lost=seen.lose)
    assert threading.active_count() <= threads + 1 + 2  # one reader thread (gRPC may add its pollers)
    assert seen.wait_for(lambda: {r for r, _ in seen.beats} == {0, 1} and len(seen.beats) >= 6)
    assert seen.beats[0][1].state == "running" and seen.beats[0][1].rss_bytes == 1 << 30
    reader.close()  # joins the reader's thread: no report can follow
    assert seen.lost == {}


def test_a_silent_stream_is_lost_after_its_stall_bound(owner: Served) -> None:
    hang = threading.Event()
    owner.handler.hang_heartbeats = hang
    seen = _Seen()
    started = time.monotonic()
    reader = HeartbeatReader([owner.client.config], interval_s=0.02, stall_s=0.3, on_beat=seen.beat,
                             on_lost=seen.lose)
    try:
        assert seen.wait_for(lambda: 0 in seen.lost)
        assert 0.3 <= time.monotonic() - started < 0.3 + 2.0
        assert "PartitionOwner.Health" in seen.lost[0] and "sent nothing for 0.3s" in seen.lost[0]
    finally:
        hang.set()
        reader.close()


def test_a_stopped_server_is_lost(owner: Served) -> None:
    seen = _Seen()
    reader = HeartbeatReader([owner.client.config], interval_s=0.02, stall_s=5.0, on_beat=seen.beat,
                             on_lost=seen.lose)
    try:
        assert seen.wait_for(lambda: len(seen.beats) >= 1)
        owner.server.stop()
        assert seen.wait_for(lambda: 0 in seen.lost)
        assert "PartitionOwner.Health" in seen.lost[0]
    finally:
        reader.close()


def test_readers_closed_one_after_another_print_nothing() -> None:
    """Each closing reader waits for gRPC's own tasks of its cancelled streams before its loop
    closes; without that, the next reader's loop printed ``RuntimeError: Event loop is closed``
    for events gRPC still had for the closed one. A process of its own, so that its stderr holds
    only what the readers printed."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "readers_run.py")
    proc = subprocess.run([sys.executable, script, str(READERS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    beats = json.loads(proc.stdout.splitlines()[-1])
    assert len(beats) == READERS and min(beats) >= 4  # every reader read its beats before it closed
    # gRPC core may log a line of its own (an INFO "Got goaway" as the server stops): not a traceback.
    for noise in ("Traceback", "Event loop is closed", "Exception in callback", "Task was destroyed", "pending"):
        assert noise not in proc.stderr, proc.stderr[-4000:]
