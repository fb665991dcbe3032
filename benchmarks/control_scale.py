"""The control plane at scale: what the driver costs per step with N owners, and how fast it
decides that one is gone.

    python -m benchmarks.control_scale --owners 8,64,256,1024

Simulated owners (``benchmarks/control_sim.py``): the real owner gRPC service (ControlServer +
OwnerControl, the job's token and header checks) over a stand-in engine that answers a step
after ``--compute-ms``, many per worker process on this machine. The driver side is the real
one (``benchmarks/control_measure.py``): an ``OwnerClient`` per owner, ``FanOut.grpc`` for the
step, ``HealthMonitor`` heartbeat streams at ZeroConfig's default interval running throughout.

With ``--relays 8 --stand-in`` (``benchmarks/control_standin.py``) the top relays are real relay
servers and every subtree below them a stand-in answering with its combined reply: the driver's
side measured at 1,024 and 8,192 owners, where simulating every owner would swamp the machine
(``benchmarks/results/control_scale_tree.{json,md}``).

Per owner count it reports the driver's added latency per step (wall time minus the compute
time), the driver process's CPU (cores, over the timed steps), the driver's CPU for heartbeats
alone (steps idle), heartbeat traffic, and the time from one owner's SIGKILL to the fan-out's
OwnerLostError. It writes ``benchmarks/results/control_scale.{json,md}`` (``--results-dir``)
and, with ``--json OUT``, the same JSON to OUT: ``{"rows": [{"owners": N,
"driver_added_ms_per_step": ..., "driver_cpu_cores": ..., "heartbeat_cpu_cores": ...,
"loss_to_decision_s": ...}, ...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.control_measure import ScaleRow, ScaleSettings, measure
from benchmarks.harness.report import machine_line
from benchmarks.harness.runner import loadavg, machine_info
from zero_ray.config import ZeroConfig
from zero_ray.errors import ZeroRayError

# The goals (issue 44, "What must show"): at GOAL_OWNERS owners the driver adds at most
# GOAL_STEP_MS to a step() and GOAL_FIT_MS to fit's, on at most GOAL_CPU_MS of its CPU a step; at
# GOAL_OWNERS_LARGE at most GOAL_FIT_LARGE_MS to fit's; heartbeats per 100 owners.
GOAL_OWNERS = 1024
GOAL_STEP_MS = 10.0
GOAL_FIT_MS = 5.0
GOAL_CPU_MS = 5.0
GOAL_OWNERS_LARGE = 8192
GOAL_FIT_LARGE_MS = 10.0
GOAL_HEARTBEAT_CORES_PER_100 = 0.01
GOAL_DECISION_S = 1.0  # a relay's (here) or an owner's SIGKILL -> OwnerLostError
BUSY_CORES = 0.9  # a Python driver this busy is bound by its one GIL

COLUMNS = ("owners", "path", "added ms/step", "fit (pipelined): added ms/step, CPU cores", "driver CPU cores", "CPU ms/step", "µs CPU/owner", "dispatch ms",
           "collect ms", "oldest beat s (driver / owner)", "heartbeat cores", "≤ 1%/100 owners", "beats/s",
           "loss → decision s", "monitor s", "decision → survivors aborted s", "below the driver",
           "load (1 min) start → end", "top relays CPU ms/step", "fit: steps begun late, ms lost")


def _cells(r: ScaleRow) -> list[str]:
    budget = GOAL_HEARTBEAT_CORES_PER_100 * r.owners / 100
    path = (f"tree: fan-out {r.relay_fan_out}, depth {r.relay_depth}, {r.owners_per_node}/node" if r.relay_fan_out
            else "direct")
    return [str(r.owners), path, f"{r.driver_added_ms_per_step:.1f}",
            f"{r.pipelined_added_ms_per_step:.1f}, {r.pipelined_cpu_cores:.2f}", f"{r.driver_cpu_cores:.2f}",
            f"{r.driver_cpu_ms_per_step:.1f}", f"{r.driver_cpu_us_per_owner:.0f}", f"{r.dispatch_ms:.1f}",
            f"{r.collect_ms:.1f}", f"{r.max_beat_age_s:.1f} / {r.owners_max_beat_gap_s:.1f}",
            f"{r.heartbeat_cpu_cores:.4f}",
            "yes" if r.heartbeat_cpu_cores <= budget else f"no ({budget:.4f})", f"{r.heartbeats_per_s:.0f}",
            f"{r.loss_to_decision_s:.3f}", f"{r.health_detect_s:.3f}",
            f"{r.abort_survivors_s:.3f}" + (f" ({r.aborted_ranks} took it)" if r.aborted_ranks >= 0 else ""),
            r.below_driver + (f", {r.top_relays} top relays" if r.top_relays else ""),
            f"{r.loadavg[0]:.1f} → {r.loadavg[1]:.1f}", f"{r.top_relays_cpu_ms_per_step:.1f}",
            f"{r.pipelined_late_steps}, {r.pipelined_late_ms:.1f}" if r.pipelined_late_steps >= 0 else "n/a"]


def table(rows: Sequence[ScaleRow]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def notes(rows: Sequence[ScaleRow]) -> list[str]:
    """Goals met or missed, each miss with where the time goes."""
    out = []
    for r in rows:
        budget = GOAL_HEARTBEAT_CORES_PER_100 * r.owners / 100
        if r.heartbeat_cpu_cores > budget:
            out.append(f"{r.owners} owners: heartbeats MISS, {r.heartbeat_cpu_cores:.4f} cores for "
                       f"{r.heartbeats_per_s:.0f} beats/s (budget {budget:.4f}): "
                       f"{r.heartbeat_cpu_cores / max(r.heartbeats_per_s, 1e-9) * 1e6:.0f} µs of driver CPU per beat")
        if r.false_losses:
            out.append(f"{r.owners} owners: live owners were declared lost (or a call timed out) {r.false_losses} "
                       f"time(s), the monitor restarted each time as a membership change does: "
                       f"{r.false_loss_reason[:300]}")
        if not r.lost_rank_ok:
            out.append(f"{r.owners} owners: the loss decision did not name the killed owner")
        if r.owners >= GOAL_OWNERS:
            ok = r.loss_to_decision_s < GOAL_DECISION_S
            out.append(f"{r.owners} owners: loss → decision {r.loss_to_decision_s:.2f} s "
                       f"(goal < {GOAL_DECISION_S:g}): {'met' if ok else 'MISS'}")
        piped = f"added latency with fit's pipelined steps {r.pipelined_added_ms_per_step:.1f} ms/step"
        if r.owners == GOAL_OWNERS_LARGE:
            ok = r.pipelined_added_ms_per_step <= GOAL_FIT_LARGE_MS
            out.append(f"{r.owners} owners: {piped} (goal ≤ {GOAL_FIT_LARGE_MS:g}): {'met' if ok else 'MISS'}")
        if r.owners != GOAL_OWNERS:
            continue
        for ok, what in ((r.driver_added_ms_per_step <= GOAL_STEP_MS,
                          f"added latency {r.driver_added_ms_per_step:.1f} ms/step (goal ≤ {GOAL_STEP_MS:g})"),
                         (r.pipelined_added_ms_per_step <= GOAL_FIT_MS, f"{piped} (goal ≤ {GOAL_FIT_MS:g})"),
                         (r.driver_cpu_ms_per_step <= GOAL_CPU_MS,
                          f"driver CPU {r.driver_cpu_ms_per_step:.1f} ms/step (goal ≤ {GOAL_CPU_MS:g})")):
            out.append(f"{r.owners} owners: {what}: {'met' if ok else 'MISS'}")
        if r.driver_cpu_cores >= BUSY_CORES:
            out.append(f"{r.owners} owners: the driver is CPU-bound ({r.driver_cpu_cores:.2f} cores): one Python "
                       f"process runs Python code on about one core at a time (the GIL), so the CPU figure is "
                       f"capped, not within budget; the added latency is what it costs")
        if r.driver_added_ms_per_step > GOAL_STEP_MS:
            out.append(f"{r.owners} owners, where the time goes: dispatch {r.dispatch_ms:.1f} ms (the step's start "
                       f"to the last owner starting), compute span {r.compute_ms:.1f} ms, collection "
                       f"{r.collect_ms:.1f} ms; driver CPU {r.driver_cpu_ms_per_step:.1f} ms/step = "
                       f"{r.driver_cpu_us_per_owner:.0f} µs per owner (one Stats call from one thread "
                       f"{r.grpc_call_cpu_us:.0f} µs, one thread-pool hand-off {r.pool_handoff_cpu_us:.0f} µs); "
                       f"{r.driver_threads} driver threads")
    return out


def render_markdown(results: dict[str, Any]) -> str:
    """The report: machine, settings, the table, the notes."""
    s = results["settings"]
    rows = [ScaleRow.from_json(r) for r in results["rows"]]
    head = (f"{machine_line(results['machine'], libraries=('torch', 'ray'))}\n\n"
            f"Simulated owners: real owner gRPC servers (token auth) over a stand-in engine computing "
            f"{s['compute_ms']:g} ms per step, up to {s['per_process']} per worker process, on this one machine "
            f"(shared with other work while measured: {s['shared']}); heartbeats every {s['health_interval_s']:g} s; "
            f"{s['steps']} timed steps after {s['warmup']} warm-up.\n\n")
    if s.get("stand_in"):
        head += ("Stand-in subtrees (--stand-in, benchmarks/control_standin.py): the driver's path and the top relays "
                 "are real (each a ControlServer serving RelayHost / RelayHop in its own process); every child of a "
                 "top relay, with its subtree, is a stand-in answering RelayStep with the combined reply of its "
                 "ranks after the compute time and Watch with their beats. Rows of depth 1 (the top relays call "
                 "owners) are the full simulation. Loss: the SIGKILL of the last stand-in relay (alone in its "
                 "process) inside a held step; the survivors' abort goes down the tree (RelayCall of Abort, "
                 "which the stand-ins answer per rank and count: 'took it').\n\n")
    body = table(rows)
    extra = "\n".join(f"- {n}" for n in results["notes"])
    threads = "\n".join(f"- {r.owners} owners: per step (ms) {_top(r.step_cpu_by_thread)}; heartbeats (cores) "
                        f"{_top(r.heartbeat_cpu_by_thread)}" for r in rows)
    # Other runs of the same command (--render of a JSON given "other_runs"): the spread on a shared machine.
    others = "".join(f"\n{run['label']}:\n\n{table([ScaleRow.from_json(r) for r in run['rows']])}\n"
                     for run in results.get("other_runs", []))
    return (head + body + "\n\n" + extra + "\n\nDriver CPU by thread group:\n\n" + threads + "\n"
            + (f"\nOther runs of the same command, for the spread:\n{others}" if others else ""))


def _top(groups: dict[str, float], count: int = 5) -> str:
    return ", ".join(f"{g} {v:g}" for g, v in list(groups.items())[:count]) or "none"


def _owners(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--owners {text!r}: a comma-separated list of counts >= 2")
    return values


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=_owners, default=[8, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per owner count")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--per-process", type=int, default=128, help="simulated owners per worker process")
    parser.add_argument("--heartbeat-window-s", type=float, default=5.0)
    defaults = ZeroConfig()
    parser.add_argument("--health-interval-s", type=float, default=defaults.health_interval_s,
                        help="ZeroConfig's default")
    parser.add_argument("--health-timeout-s", type=float, default=defaults.health_timeout_s,
                        help="ZeroConfig's default")
    parser.add_argument("--probe-calls", type=int, default=64)
    parser.add_argument("--relays", type=int, default=0, metavar="FAN_OUT",
                        help="steps down the relay tree of this fan-out (RelayPlane, as OwnerPool from "
                             "RelayConfig.min_owners on), relays hosted in the simulated owners' servers; 0: to "
                             "every owner directly. Results go to control_scale_relays.{json,md}")
    parser.add_argument("--stand-in", action="store_true",
                        help="with --relays: the top relays real, every subtree below them stood in "
                             "(benchmarks/control_standin.py), so that the driver's side is measured at 1,024 and "
                             "8,192 owners; rows of depth 1 (top relays calling owners) are the full simulation. "
                             "Results go to control_scale_tree.{json,md}")
    parser.add_argument("--owners-per-node", type=int, default=8, help="the simulated nodes the tree is planned over")
    parser.add_argument("--shared", default="yes", help="say whether other work ran on the machine meanwhile")
    parser.add_argument("--results-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--json", dest="json_out", default=None, help="also write the JSON here")
    parser.add_argument("--render", default=None, help="recompute the notes and the markdown from this JSON; "
                                                       "measure nothing")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            results = json.load(f)
        results["notes"] = (notes([ScaleRow.from_json(r) for r in results["rows"]])
                            + [f"{f['owners']} owners: no row: {f['error']}" for f in results.get("failed", [])])
        _write(results, args.results_dir, args.json_out, name=_name(results["settings"]))
        return results
    settings = ScaleSettings(compute_s=args.compute_ms / 1e3, steps=args.steps, warmup=args.warmup,
                             per_process=args.per_process, heartbeat_window_s=args.heartbeat_window_s,
                             health_interval_s=args.health_interval_s, health_timeout_s=args.health_timeout_s,
                             probe_calls=args.probe_calls, relay_fan_out=args.relays,
                             owners_per_node=args.owners_per_node, stand_in=args.stand_in)
    # Each false loss is counted in the row; the monitor's own error line per rank would flood the output.
    logging.getLogger("zero_ray.driver.health").setLevel(logging.CRITICAL)
    machine = machine_info()
    rows: list[ScaleRow] = []
    failed: list[dict[str, Any]] = []
    for n in args.owners:
        print(f"{n} owners ...", flush=True)
        t0 = time.monotonic()
        try:
            rows.append(measure(n, settings))
        except (ZeroRayError, TimeoutError) as err:  # reported in the results: a row that could not be taken
            failed.append({"owners": n, "error": f"{type(err).__name__}: {err}"[:1000]})
            print(f"  FAILED: {failed[-1]['error']}", flush=True)
        print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    machine["loadavg_end"] = loadavg()
    results = {"machine": machine,
               "settings": {"compute_ms": args.compute_ms, "steps": args.steps, "warmup": args.warmup,
                            "per_process": args.per_process, "heartbeat_window_s": args.heartbeat_window_s,
                            "health_interval_s": args.health_interval_s, "health_timeout_s": args.health_timeout_s,
                            "shared": args.shared, "owners": args.owners, "relays": args.relays,
                            "owners_per_node": args.owners_per_node, "stand_in": args.stand_in},
               "rows": [r.as_json() for r in rows], "failed": failed,
               "notes": notes(rows) + [f"{f['owners']} owners: no row: {f['error']}" for f in failed]}
    print(table(rows))
    for n in results["notes"]:
        print(f"- {n}")
    _write(results, args.results_dir, args.json_out, name=_name(results["settings"]))
    return results


def _name(settings: dict[str, Any]) -> str:
    """The results' file name: each path kept beside the others, to compare."""
    if not settings.get("relays"):
        return "control_scale"
    return "control_scale_tree" if settings.get("stand_in") else "control_scale_relays"


def _write(results: dict[str, Any], results_dir: str, json_out: str | None, *, name: str) -> None:
    text = json.dumps(results, indent=2) + "\n"
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(results_dir, f"{name}.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(results))
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
