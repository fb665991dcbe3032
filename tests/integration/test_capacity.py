"""Placement follows membership, on a local Ray of exactly 4 CPUs (its own process): a lost
owner's slot is reused by its replacement and a shrink gives its slots back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests_paths import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "capacity_run.py")


def test_slots_follow_the_owners() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    seen = json.loads(lines[-1])
    print(json.dumps(seen, indent=1))
    assert seen["before_loss"] == [3, 3, 3] and seen["free_at_3"] == 1.0  # max_world_size=4 grows nothing
    assert seen["restored_to"] == [2, 2]  # on the survivors at once
    assert seen["after_kills"] == [3, 3] and seen["free_after_kills"] == 1.0  # replaced twice, nothing leaked
    assert len(seen["recoveries"]) == 2
    assert seen["resize_4"] == 4 and seen["free_at_4"] == 0.0
    assert seen["resize_2"] == 2 and seen["free_at_2"] == 2.0  # the shrink gave its slots back
    assert seen["free_after_shutdown"] == 4.0
