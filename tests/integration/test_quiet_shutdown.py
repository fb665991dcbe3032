"""Two trainers in one process, one after the other (a notebook that trains twice), print no
traceback: a driver process of its own (tests/integration/two_trainers_run.py, connected to the
session's Ray) whose stderr is read whole. Before the heartbeat loop waited for gRPC's own tasks
of its cancelled streams, each shutdown could leave gRPC an event for a closed loop, and the
next trainer's loop printed ``RuntimeError: Event loop is closed`` (issue 42, item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

from tests_paths import REPO_ROOT

pytestmark = pytest.mark.usefixtures("ray_session")

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "two_trainers_run.py")


def test_two_trainers_in_one_process_print_no_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, SCRIPT, ray.get_runtime_context().gcs_address], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    first, second = json.loads(lines[-1])
    # Each trained: the loss fell at every step, and the second run (same seed, same batch) repeated the first.
    assert len(first) == 6 and all(b < a for a, b in zip(first, first[1:])), first
    assert second == first
    for noise in ("Traceback", "Event loop is closed", "Task was destroyed", "Exception in callback", "still pending"):
        assert noise not in proc.stderr, proc.stderr[-6000:]
