"""What compiling costs an owner at start, with inductor's cache and without.

    python -m benchmarks.compile_start [--stage 3] [--model gpt]

Each trial is a fresh Python process, as a replacement owner is: it builds one rank's
``OwnerEngine`` (world size 1) with ``ZeroConfig(compile=...)`` and takes steps, timing the
construction, the first step (which compiles every unit shape), the second (shapes already
compiled) and the median of the rest. The trials, in order:

- eager: no compile, the baseline;
- cold: compiled, inductor's cache directory new and empty (a node's first owner);
- warm: compiled, the cache directory the cold trial filled (a replacement on the same node,
  or a restarted owner: ``Compile.cache_dir``, or inductor's default ``/tmp/torchinductor_<user>``
  that every owner of a node shares).

Writes ``benchmarks/results/compile_start.{json,md}`` (``--results-dir``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness.report import machine_line
from benchmarks.harness.runner import loadavg, machine_info
from benchmarks.harness.trials import add_trial_arguments, run_child, write_results

TRIALS = ("eager", "cold", "warm")


@dataclass(frozen=True, kw_only=True)
class StartRow:
    """One trial's timings, seconds."""

    trial: str
    construct_s: float
    first_step_s: float
    second_step_s: float
    steady_step_s: float  # median of the steps after the second


def _child(stage: int, model: str, steps: int, compiled: bool) -> StartRow:
    """One owner's start, in this process (the parent sets the cache directory)."""
    import torch

    import zero_ray as zr
    from benchmarks.harness.workloads import WORKLOADS
    from zero_ray.collective.collective_api import SoloGroup
    from zero_ray.core.optimizer_plan import check_optimizer_factories
    from zero_ray.core.precision import parse_dtype
    from zero_ray.core.stages import stage_plan
    from zero_ray.owner.step.engine import OwnerEngine
    from zero_ray.owner.step.run_spec import EngineSpec

    torch.set_num_threads(1)  # as a one-CPU owner
    work = WORKLOADS[model]()
    stage3 = zr.Stage3Config(wrap_policy=work.fsdp_units) if stage == 3 else zr.Stage3Config()
    spec = EngineSpec(model_fn=work.model_fn, loss_fn=work.loss_fn,
                      optimizers=check_optimizer_factories(zr.AdamW(lr=1e-3)), plan=stage_plan(stage),
                      compute_dtype=parse_dtype("float32"), device="cpu", seed=0, bucket_bytes=25 * 2**20,
                      grad_accum_steps=1, max_grad_norm=None, loss_scale=zr.LossScaleConfig(), stage3=stage3,
                      compile=zr.Compile() if compiled else None)
    batches = work.batches(steps, world_size=1, seed=0)
    start = time.perf_counter()
    engine = OwnerEngine(spec, rank=0, group=SoloGroup())
    construct = time.perf_counter() - start
    took = []
    for batch in batches:
        start = time.perf_counter()
        engine.step(batch, global_samples=work.global_batch(1))
        took.append(time.perf_counter() - start)
    return StartRow(trial="", construct_s=construct, first_step_s=took[0], second_step_s=took[1],
                    steady_step_s=statistics.median(took[2:]))


def _trial(name: str, args: argparse.Namespace, cache_dir: str) -> StartRow:
    data = run_child("benchmarks.compile_start", ["--stage", str(args.stage), "--model", args.model, "--steps",
                                                  str(args.steps)] + ([] if name == "eager" else ["--compiled"]),
                     name=name, timeout_s=args.timeout, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir))
    return StartRow(**{**data, "trial": name})


def render(rows: list[StartRow], *, stage: int, model: str, machine: str) -> str:
    lines = [f"Owner start with torch.compile (`python -m benchmarks.compile_start --stage {stage} --model {model}`), "
             f"one rank, one thread; {machine}", "",
             "| trial | construct (s) | first step (s) | second step (s) | steady step (s) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.trial} | {r.construct_s:.2f} | {r.first_step_s:.2f} | {r.second_step_s:.3f} | "
                     f"{r.steady_step_s:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--model", default="gpt", choices=("gpt", "mlp"))
    parser.add_argument("--steps", type=int, default=6, help="steps per trial, at least 3 (default 6)")
    add_trial_arguments(parser, timeout_s=900.0)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps={args.steps}: at least 3 (the first compiles, the second is timed apart)")
    if args.child:
        print(json.dumps(asdict(_child(args.stage, args.model, args.steps, args.compiled))))
        return 0
    info: dict[str, Any] = machine_info()
    with tempfile.TemporaryDirectory(prefix="zr-inductor-") as cache:
        rows = [_trial(name, args, cache) for name in TRIALS]
    info["loadavg_end"] = loadavg()
    table = render(rows, stage=args.stage, model=args.model, machine=machine_line(info))
    write_results(args.results_dir, "compile_start", {"stage": args.stage, "model": args.model, "machine": info,
                                                      "rows": [asdict(r) for r in rows]}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
