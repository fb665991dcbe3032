"""A driver SIGKILLed mid-run on a `ray start` cluster, with no checkpoint directory: its detached
owners keep the run, `zero-ray status` lists it, a second driver process attaches and finishes
the fit over the same token files (mid-epoch), and the parameters equal the uninterrupted run's. Owners no driver reattaches end themselves
after orphan_timeout_s, dropping the desired size their resize kept in Ray (as the second driver's
shutdown drops its run's). Uses a Ray head of its own (not the session's)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zero_ray as zr
from fit_order import reference_block_indices, token_windows
from ray_head import Head, ray_head
from tests_paths import REPO_ROOT
from zero_ray.testing import single_process

SCRIPT = os.path.join(REPO_ROOT, "tests", "integration", "detached_run.py")
# Long enough for `zero-ray status` (a Python process that imports torch and joins the cluster) to
# list the orphaned run before its owners end themselves on a loaded machine: at 8 s it missed once.
ORPHAN_S = 20.0


def _env(head: Head) -> dict[str, str]:
    env = head.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return env


def _launch_first(head: Head, out: Path, orphan_s: float) -> subprocess.Popen[bytes]:
    out.mkdir()
    log = (out / "first.log").open("wb")
    return subprocess.Popen([sys.executable, SCRIPT, "first", str(out), str(orphan_s)], env=_env(head), cwd=REPO_ROOT,
                            stdout=log, stderr=subprocess.STDOUT)


def _run_written(proc: subprocess.Popen[bytes], out: Path) -> dict:
    """run.json, once the first driver has written it (its run stepping, detached)."""
    deadline = time.monotonic() + 240
    while not (out / "run.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the first driver never wrote run.json:\n{(out / 'first.log').read_text()[-4000:]}")
        time.sleep(0.2)  # polling for a file another process writes
    return json.loads((out / "run.json").read_text())


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: it is stepping
    proc.wait(timeout=30)


def _status(head: Head) -> str:
    out = subprocess.run([sys.executable, "-m", "zero_ray.cli", "status"], env=_env(head), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.timeout(900)
def test_a_second_driver_attaches_and_finishes_the_run(tmp_path: Path) -> None:
    import detached_run as run

    tokens = run.corpus_tokens()
    samples, per = (len(tokens) - 1) // run.SEQ, run.BLOCK_TOKENS // run.SEQ
    sizes = [per] * (samples // per) + ([samples % per] if samples % per else [])
    order = reference_block_indices(sizes, global_batch_size=run.BATCH, steps=run.STEPS, seed=run.SEED,
                                    window=run.WINDOW)
    batches = [token_windows(tokens, run.SEQ, idx) for idx in order]
    ref, _ = single_process(run.model, run.token_mse, zr.SGD(lr=0.1, momentum=0.9), batches)
    with ray_head(num_cpus=8) as head:  # CPUs for both runs' owners (3 each until resized) at once, and a grow
        # Run a (attached again below) and run b (no driver reattaches: its owners end themselves
        # after orphan_timeout_s) share the head and overlap: each driver start is mostly waits.
        procs = [_launch_first(head, tmp_path / "a", orphan_s=120.0),
                 _launch_first(head, tmp_path / "b", orphan_s=ORPHAN_S)]
        try:
            info = _run_written(procs[0], tmp_path / "a")
            _kill(procs[0])
            orphan_info = _run_written(procs[1], tmp_path / "b")
            owners = [os.pidfd_open(pid) for pid in orphan_info["owner_pids"]]  # opened while the owners are alive
            _kill(procs[1])
            killed = time.monotonic()
            listing = _status(head)
            assert info["run_id"] in listing and orphan_info["run_id"] in listing, listing
            out, err = (tmp_path / "second.out").open("w+"), (tmp_path / "second.err").open("w+")
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "second", str(tmp_path / "a"), info["run_id"]],
                                          env=_env(head), cwd=REPO_ROOT, stdout=out, stderr=err, text=True))
            # A pidfd turns readable when its process ends: a wait bounded in time, without polling
            # `zero-ray status` (each call a Python process that imports torch and joins the cluster).
            while owners:
                left = killed + ORPHAN_S + 60 - time.monotonic()
                assert left > 0, f"the orphaned owners of {orphan_info['run_id']} are still alive"
                ended, _, _ = select.select(owners, [], [], left)
                for fd in ended:
                    owners.remove(fd)
                    os.close(fd)
            gone = time.monotonic() - killed
            second = procs[-1]
            second.wait(timeout=600)
        finally:
            for proc in procs:
                if proc.poll() is None:  # an assertion above failed: the head is torn down next
                    proc.kill()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
        assert second.returncode == 0, f"{stdout[-3000:]}\n{stderr[-6000:]}"
        summary = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
        print(json.dumps(summary, indent=1))
        got = torch.load(tmp_path / "a" / "final.pt")
        assert summary["step"] == run.STEPS and summary["resumed"] >= run.STEPS_BEFORE
        # The resize before the loss holds: room for the config's size is free, and no grow took it.
        assert (summary["world_size"], summary["desired_world_size"]) == (run.RESIZED, run.RESIZED), summary
        # The position comes back from the owners: samples too, not only steps.
        assert summary["resumed_samples"] == 12 * summary["resumed"] and summary["samples_seen"] == 12 * run.STEPS
        assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-6
        assert all(b > 0 for b in summary["nvme"])  # the attached owners' state was still in its files
        listing = _status(head)
        assert info["run_id"] not in listing  # the second driver shut the run down
        assert orphan_info["run_id"] not in listing  # its owners ended
        # Both runs recorded their resize; neither record outlives its run: the second driver's
        # shutdown drops run a's, the orphaned owners drop run b's as they end.
        assert info["recorded"] == orphan_info["recorded"] == run.RESIZED
        kept = subprocess.run([sys.executable, SCRIPT, "recorded", info["run_id"], orphan_info["run_id"]],
                              env=_env(head), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert kept.returncode == 0, kept.stderr[-3000:]
        assert json.loads(kept.stdout.splitlines()[-1]) == {info["run_id"]: None, orphan_info["run_id"]: None}
        print(f"orphaned owners gone {gone:.1f}s after their driver was killed "
              f"(orphan_timeout_s={ORPHAN_S:g})")
