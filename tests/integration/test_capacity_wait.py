"""Start-up waits for room, within a bound (core/capacity.py, driver/pool_spec.await_room).

On a Ray cluster of its own: a trainer of 2 owners on a cluster with room for 1, whose second
node joins 5 s later, waits (saying so), then starts and trains as one process would. On the
session's Ray: at the bound, the error names what was missing, the bound and the fix."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

import zero_ray as zr
from tests_paths import REPO_ROOT
from zero_ray.models import mlp, mse_loss

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "capacity_wait_run.py")


def test_two_owners_on_room_for_one_wait_for_the_node_that_joins_5s_later_then_train() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])
    print(json.dumps(out, indent=1))
    # Before the join: one node, its one CPU taken by the first owner, the trainer still starting
    # and saying what it waits for.
    assert out["waiting_logged"] and out["constructing_at_join"]
    assert out["nodes_at_join"] == 1 and out["free_cpu_at_join"] == 0.0
    assert out["waiting_lines_before_join"] >= 1
    assert out["waiting_lines"][0].startswith("waiting for 1 more owner slot: 2 owners need {'CPU': 1} each; "
                                              "the cluster's live nodes hold 1")
    # After it: started, on both nodes, and trained as one process does on the same batches.
    assert out["error"] is None and out["started_after_join_s"] is not None
    assert out["owner_nodes"] == 2
    assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-5, abs=1e-7)
    assert out["dev"] <= 1e-6


@pytest.mark.usefixtures("ray_session")
def test_at_the_bound_the_error_names_the_missing_gpus_the_bound_and_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    """No GPU on the session's Ray: a CUDA owner's request waits, is reported, and fails at the bound."""
    caplog.set_level(logging.INFO, logger="zero_ray")
    start = time.monotonic()
    with pytest.raises(zr.ResourceError) as caught:
        zr.ZeroTrainer(lambda: mlp(8, 2), mse_loss,
                       config=zr.ZeroConfig(world_size=1, device="cuda", capacity_timeout_s=2.0))
    waited = time.monotonic() - start
    text = str(caught.value)
    assert "lacked 1 more owner slot after waiting capacity_timeout_s=2s" in text
    assert "1 owners need {'GPU': 1, 'CPU': 1} each; the cluster's live nodes hold 0" in text
    assert "add GPU nodes" in text and "device='cpu'" in text
    assert 2.0 <= waited < 30.0
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert waiting and "capacity_timeout_s=2s" in waiting[0]


@pytest.mark.usefixtures("ray_session")
def test_auto_on_a_machine_without_gpus_picks_the_cpu_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from zero_ray.driver.trainer import _resolve_device

    caplog.set_level(logging.INFO, logger="zero_ray")
    assert _resolve_device(zr.ZeroConfig(world_size=2)) == ("cpu", "gloo")
    said = [r for r in caplog.records if "device='auto' chose the CPU" in r.getMessage()]
    # The session's Ray is this one machine, without GPUs: said, but not as a warning (a laptop's case).
    assert said and said[0].levelno == logging.INFO and "use device='cuda'" in said[0].getMessage()
