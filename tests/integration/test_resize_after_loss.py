"""A resize shortly after a loss, while the loss's replacement is still starting (a regression:
the replacement held a slot that the grow did not count, so ``resize(4)`` on a 4-CPU cluster
failed with "needs 2 more slots ... but the cluster has 1 free"). Runs in its own process on a
Ray of exactly 4 CPUs (resize_after_loss_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests_paths import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "resize_after_loss_run.py")


def test_resize_while_the_replacement_starts_at_stages_1_and_3() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, SCRIPT, "1", "3"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT)
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(runs) == 2, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for seen in runs:
        print(seen)
        assert seen["lost"] == [[1]]  # the kill fired, and was survived
        # The regression's condition: the replacement started for the 3-owner run holds the
        # fourth CPU but has not joined (its start, a Ray worker importing torch, takes seconds).
        assert seen["before_resize"] == 2 and seen["replacement_starting"], seen
        assert "resize_error" not in seen, seen["resize_error"]
        assert seen["resize"] == [2, 4] and seen["after"] == 4  # nothing grew or shrank behind the resize
        assert seen["dev"] <= 1e-6  # equal to one process
