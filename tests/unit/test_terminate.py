"""Ending a frozen owner's process: only a process whose title is an owner's is killed."""

from __future__ import annotations

import signal
import subprocess
import time

from zero_ray.driver.terminate import OWNER_TITLE, _sigkill_if_owner


def _start(title: str) -> subprocess.Popen[bytes]:
    """A process whose /proc/<pid>/cmdline starts with ``title`` (as Ray's setproctitle makes
    an actor's): bash execs sleep under that argv[0] once it has started."""
    proc = subprocess.Popen(["bash", "-c", f"exec -a '{title}' sleep 60"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait for the exec (a condition, bounded)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            if fh.read().startswith(title.encode()):
                return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"the process never took the title {title!r}")


def test_a_frozen_owner_process_is_killed() -> None:
    proc = _start(OWNER_TITLE)
    try:
        proc.send_signal(signal.SIGSTOP)  # a frozen owner: it cannot answer anything
        assert _sigkill_if_owner(proc.pid, OWNER_TITLE) is True
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()


def test_a_process_with_another_title_is_left_alone() -> None:
    proc = _start("some-other-program")
    try:
        assert _sigkill_if_owner(proc.pid, OWNER_TITLE) is False
        assert proc.poll() is None  # still running
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_process_that_is_gone_is_no_error() -> None:
    proc = _start(OWNER_TITLE)
    proc.kill()
    proc.wait(timeout=10)
    assert _sigkill_if_owner(proc.pid, OWNER_TITLE) is False
