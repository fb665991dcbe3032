"""The simulated cluster's clean-up by name: leftovers of a process that is gone are removed at
the next start (network namespaces and the bridge), and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.harness.simcluster import available, sweep

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


def _gone_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30, check=True)
    return int(proc.stdout)


def test_sweep_removes_a_dead_process_leftovers_only() -> None:
    dead = _gone_pid()
    ns, bridge = f"zrsim-{dead}-n0", f"zrs{dead:06x}b"
    mine = f"zrsim-{os.getpid()}-n9"  # a live process's: kept
    for cmd in (["ip", "netns", "add", ns], ["ip", "link", "add", bridge, "type", "bridge"], ["ip", "netns", "add", mine]):
        subprocess.run(cmd, check=True, timeout=20)
    try:
        removed = sweep()
        assert ns in removed and bridge in removed and mine not in removed
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
        assert ns not in left and mine in left
    finally:
        for cmd in (["ip", "netns", "delete", ns], ["ip", "link", "delete", bridge], ["ip", "netns", "delete", mine]):
            subprocess.run(cmd, capture_output=True, timeout=20)
