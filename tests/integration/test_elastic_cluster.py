"""A real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a worker node
is removed mid-run (its owners are lost), the run restores from peer memory at the size left,
then grows back when a node is added. Runs in its own process: it needs its own Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests_paths import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "elastic_cluster_run.py")


@pytest.mark.parametrize("stage", [2])  # stages 1-3 x ray.kill are in test_recovery.py
def test_node_removed_then_added(stage: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, SCRIPT, str(stage)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])
    print(json.dumps(out, indent=1))
    assert out["dev"] <= 1e-6  # the same parameters as one process on the same global batches
    assert out["sizes"][:3] == [4, 4, 4] and min(out["sizes"]) < 4  # the node's owners were lost
    # and it grew back once a node joined, within the runner's 180 s from the join
    assert out["sizes"][-1] == 4 and out["grow_back_s"] is not None
    assert len(out["recoveries"]) == 1 and "restore from peer" in out["recoveries"][0]
