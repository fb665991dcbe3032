"""Replacements started ahead in a detached run (issue 46): how soon the pool is whole again.

    python -m benchmarks.detached_growback growback [--attached]
    PYTHONPATH=.:tests python -m benchmarks.detached_growback attach|orphan [--orphan-s 20]

``growback``: a 3-owner run (``continue_on_survivors``, peer redundancy) on a local Ray cluster;
after 3 steps one owner is SIGKILLed and the driver keeps stepping (0.2 s apart, a step of a
real run being at least that long) until the pool is back at 3 owners. Prints the seconds from
the kill to the run on the survivors and to the pool whole again, and ``uptime``'s load.

``attach`` / ``orphan`` (a ``ray start`` head of their own: tests/ray_head.py): a first driver
process of a detached run loses an owner, recovers onto the survivors (a replacement starting
ahead, standby) and is SIGKILLed before the grow takes it in. ``attach``: a second driver
attaches, which must find the 2 members only and end the standby owner, then grows back.
``orphan``: nobody attaches; the standby owner must end itself after ``orphan_timeout_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WORLD = 3


def _model() -> torch.nn.Module:
    from zero_ray.models import mlp

    return mlp(8, 2)


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = module(batch)
    return F.mse_loss(out, torch.zeros_like(out))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(i))


def _config(*, detached: bool, orphan_s: float) -> object:
    import zero_ray as zr

    return zr.ZeroConfig(stage=2, world_size=WORLD, health_interval_s=0.2, health_timeout_s=5.0,
                         elastic=zr.ElasticConfig(detached=detached, orphan_timeout_s=orphan_s, redundancy="peer"))


def _names() -> list[str]:
    import ray

    return sorted(e["name"] if isinstance(e, dict) else e for e in ray.util.list_named_actors(all_namespaces=True))


def growback(detached: bool) -> dict[str, object]:
    import ray

    import zero_ray as zr

    ray.init(num_cpus=WORLD + 1, log_to_driver=False, include_dashboard=False)
    load = os.getloadavg()
    trainer = zr.ZeroTrainer(_model, _loss, optimizer=zr.SGD(lr=0.1), config=_config(detached=detached, orphan_s=120.0))
    try:
        for i in range(3):
            trainer.step(_batch(i))
        os.kill(ray.get(trainer.actors[WORLD - 1].node.remote(), timeout=60)["pid"], signal.SIGKILL)
        killed, shrunk, steps = time.monotonic(), None, 0
        while time.monotonic() - killed < 120:
            trainer.step(_batch(steps))
            steps += 1
            if trainer.world_size < WORLD and shrunk is None:
                shrunk = time.monotonic() - killed
            if trainer.world_size == WORLD and trainer.recoveries:
                break
            time.sleep(0.2)  # pacing: a real run's step takes at least this long
        return {"detached": detached, "on_survivors_after_s": round(shrunk or -1.0, 1),
                "whole_after_s": round(time.monotonic() - killed, 1), "steps_meanwhile": steps,
                "world_size": trainer.world_size, "load_before": [round(x, 2) for x in load],
                "load_after": [round(x, 2) for x in os.getloadavg()]}
    finally:
        trainer.shutdown()


def first(out: Path, orphan_s: float) -> None:
    """The first driver: lose an owner, recover onto the survivors, record, wait to be killed."""
    import ray

    import zero_ray as zr

    ray.init(log_to_driver=False)
    trainer = zr.ZeroTrainer(_model, _loss, optimizer=zr.SGD(lr=0.1), config=_config(detached=True, orphan_s=orphan_s))
    for i in range(3):
        trainer.step(_batch(i))
    os.kill(ray.get(trainer.actors[WORLD - 1].node.remote(), timeout=60)["pid"], signal.SIGKILL)
    trainer.step(_batch(3))  # recovers onto the survivors; a replacement starts ahead, standby
    started = trainer._pool.replacements.started
    assert started is not None, "no replacement was started ahead"
    spare = ray.get(started.answers[0], timeout=60)["pid"]
    (out / "run.json").write_text(json.dumps({"run_id": trainer.run_id, "world_size": trainer.world_size,
                                              "names": _names(), "spare_pid": spare}))
    threading.Event().wait()


def second(run_id: str) -> None:
    """The second driver: attach, then step until the run is whole again."""
    import ray

    import zero_ray as zr

    ray.init(log_to_driver=False)
    before, t0 = _names(), time.monotonic()
    trainer = zr.ZeroTrainer.attach(run_id, _model, _loss)
    attach_s, after, attached = time.monotonic() - t0, _names(), trainer.world_size
    t0 = time.monotonic()
    try:
        while trainer.world_size < WORLD and time.monotonic() - t0 < 90:
            trainer.step(_batch(trainer.step_count))
            time.sleep(0.2)
        print(json.dumps({"names_before": before, "attach_s": round(attach_s, 1), "names_after_attach": after,
                          "world_size_attached": attached, "world_size_later": trainer.world_size,
                          "grow_back_s": round(time.monotonic() - t0, 1)}))
    finally:
        trainer.shutdown()


def driver_loss(mode: str, out: Path, orphan_s: float) -> None:
    from ray_head import ray_head  # tests/ray_head.py: a `ray start` head of its own

    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").unlink(missing_ok=True)  # an earlier run's
    with ray_head(num_cpus=WORLD + 1) as head:
        env = head.env()
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
        with (out / "first.log").open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.detached_growback", "first", "--out", str(out),
                                     "--orphan-s", str(orphan_s)], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not (out / "run.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit((out / "first.log").read_text()[-3000:])
            time.sleep(0.2)  # polling for a file another process writes
        info = json.loads((out / "run.json").read_text())
        spare = os.pidfd_open(info["spare_pid"])  # opened while it is alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed = time.monotonic()
        print(json.dumps(info))
        if mode == "orphan":
            ended, _, _ = select.select([spare], [], [], orphan_s + 60)
            print(json.dumps({"standby_ended": bool(ended), "after_driver_kill_s": round(time.monotonic() - killed, 1),
                              "orphan_timeout_s": orphan_s}))
            return
        done = subprocess.run([sys.executable, "-m", "benchmarks.detached_growback", "second", "--run-id",
                               info["run_id"]], env=env, capture_output=True, text=True, timeout=300)
        print(next((line for line in done.stdout.splitlines() if line.startswith("{")), done.stderr[-4000:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["growback", "attach", "orphan", "first", "second"])
    parser.add_argument("--attached", action="store_true", help="growback: an attached run, for comparison")
    parser.add_argument("--orphan-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/zero_ray_detached_growback"))
    parser.add_argument("--run-id", default="")
    args = parser.parse_args()
    if args.mode == "growback":
        print(json.dumps(growback(detached=not args.attached)))
    elif args.mode == "first":
        first(args.out, args.orphan_s)
    elif args.mode == "second":
        second(args.run_id)
    else:
        driver_loss(args.mode, args.out / args.mode, args.orphan_s if args.mode == "orphan" else 60.0)


if __name__ == "__main__":
    main()
