"""Time from an owner's loss to the next completed step, at each point of a run's life.

    python -m benchmarks.recovery_time [--world-size 4 --stage 2 --points backward,freeze,...]

For each kill point (``tests/faults.py``: ``KILL_POINTS``) a fresh run of ``--world-size``
owners with peer redundancy trains, and once 3 steps are done the owner the point names is
SIGKILLed: inside backward; in a shrink's transfer, in the group a shrink forms after it, right
after a shrink; in a grow's group formation (the new owner) or transfer; during the restore
after a first loss, a peer snapshot or a checkpoint save; or SIGSTOPped (``freeze``). The run
continues on the survivors (the default) except at the points whose restore waits for a
replacement (``faults.WAITS``: the resizes, and the replacement killed in its restore). Reports the
kill-to-next-completed-step time and each recovery's detect / abort / restore / replay seconds,
and checks the final parameters against the same run without a kill. Writes
benchmarks/results/recovery_time_w<N>.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

import zero_ray as zr
# Fault injection lives with the tests (the library knows nothing of it); the benchmark borrows it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import faults  # noqa: E402
from faults import KILL_POINTS, WAITS, run_with_kill  # noqa: E402
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(faults)  # its model_fn wrapper runs in the owners' processes
from zero_ray.models import mlp, mse_loss

RESULTS = Path(__file__).parent / "results"
AT = 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="long enough for replacements to join")
    ap.add_argument("--health-timeout", type=float, default=5.0)
    ap.add_argument("--points", default=",".join(KILL_POINTS), help=f"comma-separated, of {KILL_POINTS}")
    args = ap.parse_args()
    ray.init(num_cpus=max(8, 2 * args.world_size + 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    n, per = args.world_size, 8
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n * per, args.width, generator=g), torch.randn(n * per, args.width, generator=g))
               for _ in range(args.steps)]
    model_fn = functools.partial(mlp, args.width, args.depth)
    opt = zr.SGD(lr=0.01, momentum=0.9)
    base = dict(stage=args.stage, world_size=n, health_interval_s=0.5, health_timeout_s=args.health_timeout,
                elastic=zr.ElasticConfig(redundancy="peer"))
    reference = zr.ZeroTrainer(model_fn, mse_loss, optimizer=opt, config=zr.ZeroConfig(**base))
    try:
        normal = [reference.step(b)["step_seconds"] for b in batches]
        expected = reference.full_state_dict()
    finally:
        reference.shutdown()
    rows = []
    for point in args.points.split(","):
        marks = tempfile.mkdtemp(prefix="zr-recovery-")
        config = zr.ZeroConfig(**{**base, "elastic": zr.ElasticConfig(redundancy="peer",
                                                                      continue_on_survivors=point not in WAITS)},
                               checkpoint=zr.CheckpointConfig(dir=os.path.join(marks, "ckpt")))
        run = run_with_kill(point, model_fn=model_fn, loss_fn=mse_loss, optimizer=opt, batches=batches, config=config,
                            at=AT, marks=marks)
        dev = max(float((run.params[k] - expected[k]).abs().max()) for k in expected)
        for r in run.recoveries:
            rows.append({"point": point, "kill_to_next_step_s": run.kill_to_next_step_s,
                         "kill_to_full_size_s": run.kill_to_full_size_s, "detect_s": r.detect_s,
                         "abort_s": r.abort_s, "restore_s": r.restore_s, "replay_s": r.replay_s, "source": r.source,
                         "sizes": f"{r.world_size_before} -> {r.world_size_after}", "max_abs_dev": dev,
                         "notes": run.notes})
            print(f"{point}: {r.summary()} -> next step {run.kill_to_next_step_s:.2f}s after the kill; "
                  f"max |Δ| vs no kill {dev:.1e}")
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
               f"{[round(x, 2) for x in os.getloadavg()]}")
    md = ["# Recovery time by kill point", "",
          f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} · {machine} · torch {torch.__version__} · ray {ray.__version__}", "",
          f"{n} owners, stage {args.stage}, {args.depth} x Linear({args.width}), SGD, peer redundancy, "
          f"health_timeout_s={args.health_timeout:g}; the owner each point names (tests/faults.py) "
          f"SIGKILLed (``freeze``: SIGSTOPped) once {AT} steps are done. A normal step took {sorted(normal)[len(normal) // 2]:.2f} s (median). Seconds:", "",
          "| kill point | kill -> next step | detect | abort | restore | replay | owners | back to the size before "
          "| max abs Δ vs no kill |",
          "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    md += [f"| {r['point']} | {r['kill_to_next_step_s']:.2f} | {r['detect_s']:.2f} | {r['abort_s']:.2f} | "
           f"{r['restore_s']:.2f} | {r['replay_s']:.2f} | {r['sizes']} | "
           + ("—" if r["kill_to_full_size_s"] is None else f"{r['kill_to_full_size_s']:.2f}")
           + f" | {r['max_abs_dev']:.1e} |" for r in rows]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"recovery_time_w{n}.json").write_text(json.dumps({"machine": machine, "normal_step_s": normal,
                                                            "rows": rows}, indent=1))
    (RESULTS / f"recovery_time_w{n}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
