"""A long run under about one fault a minute on the simulated cluster (issue 46): goodput, every
fault's time lost, every sample and checkpoint accounted for.

    python -m benchmarks.soak [--minutes 30 --seed 46 --fault-interval-s 60 --json PATH]

Two simulated nodes (benchmarks/harness/simcluster.py: network namespaces, 2 CPUs a node, the
driver on the head; this process supervises it: the training driver is a child,
benchmarks/soak_driver.py, which ``driver_sigkill`` SIGKILLs and replaces by one that attaches),
four owners at stage 2 with peer redundancy, SGD. The workload is the main job's GPT trained by
``fit`` on token files on a local S3 server (tests/s3_server.py, moto, bound to the head's address
so the far node's owners read it too), checkpoints to the same S3 every CHECKPOINT_EVERY steps.
After fault-free baselines, the soak fires a seeded schedule of faults
(benchmarks/harness/soak_faults.py) for ``--minutes``; fit runs in chunks of CHUNK steps
throughout (the baseline in the same chunks, so both pay the same per-call cost).

Measured: each fault's detect / decide / restore / replay seconds and steps lost (the run's
RecoveryReports), its time lost; goodput = the sum over world sizes of (soak steps taken at that
size x its fault-free seconds a step) / the soak's wall time (benchmarks/harness/goodput.py). The
fault-free seconds a step pool baselines at 4, 3 and 2 owners before the soak with calibrations:
a fault-free chunk every ``--calibrate-every-s`` soak seconds, run whenever no fault is in flight
with the soak's clock stopped, so that the reference sees the machine's load as the faults do
(a fault-free soak measured 79.8% against the baselines before it alone). Checked at the end: the final
parameters against one process trained on the documented order (tests/fit_order.py: SGD, 1e-6),
every epoch's samples read once each, every committed checkpoint verified (every block checksum
and file hash) with its step and samples. Writes the JSON (with ``goodput``) and a Markdown table
beside it (default benchmarks/results/soak.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# The S3 server and the documented order live with the tests (the library knows neither).
sys.path.insert(0, str(REPO / "tests"))

from benchmarks.harness.soak_faults import DRIVER_SIGKILL, FaultRecord  # noqa: E402 - after the path
from benchmarks.harness.soak_journal import Journal, JournalState  # noqa: E402
from benchmarks.soak_driver import BATCH, BLOCK_TOKENS, CHUNK, SEED, SEQ, WINDOW, gpt  # noqa: E402

CORPUS_TOKENS = 200_000  # 6,249 samples, 520 steps an epoch; more than the owners' block caches hold
# As tests/integration/partition_run.py: a 5 s cut is ridden through when about twice it is under
# both timeouts (docs/elastic.md, "Partitions"), and the long cut outlasts both (17 s, over the
# collective timeout: benchmarks/soak_driver.py). Defaults; --health-timeout-s / --health-interval-s.
# 9 s with a beat every 0.5 s (was 12 s, 3 s): a 5 s cut stalls the streams about 7.4 s, plus up
# to one interval of silence before it; frozen owners found 3 s sooner (docs/elastic.md, "Soak").
HEALTH_TIMEOUT_S = 9.0
# A round of fault-free chunks every this many soak seconds, once no fault has been in flight for
# 20 s, with the soak's clock stopped: one at the run's size and one at another size in turn (a
# resize there and back inside the round), goodput's reference in the soak's own stretch of load
# (harness/goodput.Calibration). About 13 rounds in 30 minutes, 2,600 steps beside the 600 before.
CALIBRATE_EVERY_S = 120.0
HEALTH_INTERVAL_S = 0.5
S3_PORT, LINK_MBIT, NODES, CPUS_PER_NODE = 9555, 1000.0, 2, 2
# The full disk: a tmpfs that holds a few checkpoints of this GPT (about 0.5 MB each), filled to
# all but DISK_LEAVE_BYTES before the save it refuses.
DISK_BYTES, DISK_LEAVE_BYTES = 8 << 20, 8 << 10


def _corpus() -> Any:
    import numpy as np

    return np.random.default_rng(46).integers(0, 256, size=CORPUS_TOKENS).astype("<u2")


def _block_sizes(tokens: Any) -> list[int]:
    samples, per = (len(tokens) - 1) // SEQ, BLOCK_TOKENS // SEQ
    return [per] * (samples // per) + ([samples % per] if samples % per else [])


def _epochs(order: list[list[int]], samples: int) -> dict[str, Any]:
    """Every epoch of the documented order reads distinct samples, all of them but the dropped
    remainder in each complete epoch."""
    per_epoch = samples // BATCH
    complete, bad = 0, []
    for e in range(0, len(order), per_epoch):
        read = [i for batch in order[e:e + per_epoch] for i in batch]
        if len(set(read)) != len(read) or not all(0 <= i < samples for i in read):
            bad.append(e // per_epoch)
        if len(order[e:e + per_epoch]) == per_epoch:
            complete += 1
    return {"samples": samples, "per_epoch": per_epoch * BATCH, "complete_epochs": complete,
            "partial_epoch_steps": len(order) % per_epoch, "epochs_reading_a_sample_twice": bad}


def _driver(spec_path: str, log: str, attach: str | None = None, standby: bool = False) -> subprocess.Popen[bytes]:
    """A training driver (benchmarks/soak_driver.py), in this (the head's) namespace; ``standby``:
    one started ahead, waiting for the run id on its stdin."""
    argv = [sys.executable, "-m", "benchmarks.soak_driver", spec_path]
    argv += ["--attach", attach] if attach else ["--standby"] if standby else []
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if standby else None)


def _supervise(spec: dict[str, Any], spec_path: str, deadline_s: float,
               standby: bool, load: list[float]) -> tuple[JournalState, list[dict[str, Any]]]:
    """Run the training driver to the soak's end; SIGKILL it when it asks (``driver_sigkill``)
    and hand the run at once to a driver that attaches, as a Ray job's retry would: one started
    then, or with ``standby`` one started ahead (imported and connected to Ray, waiting). The
    journal, and each kill: when (soak seconds), the pid, how the process ended, the next driver's pid;
    ``load`` gets the load average as the soak begins."""
    logs = os.path.join(os.path.dirname(spec_path), "driver-{}.log")
    state, journal, kills = JournalState(), Journal(spec["journal"]), []
    proc = _driver(spec_path, logs.format(0))
    spare = _driver(spec_path, logs.format("standby-0"), standby=True) if standby else None
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            for line in journal.read_new():
                state.add(line)
            if state.t0 is not None and not load:  # the soak began: the load then (the drivers change)
                load.extend(round(x, 2) for x in os.getloadavg())
            if len(state.kills) > len(kills) and state.kills[len(kills)] == proc.pid:
                os.kill(proc.pid, signal.SIGKILL)
                at = time.monotonic()
                rc = proc.wait(timeout=30)
                if spare is not None and spare.poll() is None and spare.stdin is not None:
                    spare.stdin.write(f"{state.run_id}\n".encode())
                    spare.stdin.flush()
                    proc, spare = spare, _driver(spec_path, logs.format(f"standby-{len(kills) + 1}"), standby=True)
                else:
                    proc = _driver(spec_path, logs.format(len(kills) + 1), attach=state.run_id)
                kills.append({"t_s": round(state.soak_s(at), 3), "pid": state.kills[len(kills)],
                              "returncode": rc, "next_pid": proc.pid, "standby": spare is not None})
                continue
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the soak's driver did not finish within {deadline_s:g}s")
            time.sleep(0.1)  # polling a file other processes append to; bounded by the deadline above
    finally:
        if spare is not None and spare.stdin is not None:
            spare.stdin.close()  # an empty line: the spare ends
            spare.wait(timeout=60)
    for line in journal.read_new():
        state.add(line)
    if proc.returncode != 0 or state.end is None:
        tail = Path(logs.format(len(kills))).read_text(errors="replace")[-6000:]
        raise SystemExit(f"the soak's driver failed ({proc.returncode}):\n{tail}")
    return state, kills


def _driver_kills(records: list[FaultRecord], state: JournalState, kills: list[dict[str, Any]]) -> None:
    """Each driver_sigkill's record from the supervisor's side: fired once the process died of
    SIGKILL and a new driver attached; restore = the kill to attach's return (a Python process,
    Ray's connection, attach: find, Status, settle), replay = from there to its first step
    (fit's dataset registration again, and any replay)."""
    asked = [r for r in records if r.kind == DRIVER_SIGKILL and not r.missed]
    for rec, kill, attached in zip(asked, kills, state.attached):
        first = next((s for s in state.steps if s.t_s > attached.t_s), None)
        rec.fired = kill["returncode"] == -signal.SIGKILL and attached.pid == kill["next_pid"]
        ready = state.ready.get(attached.pid)
        connected = "" if ready is None or state.t0 is None else f", connected to Ray at {state.soak_s(ready):.1f} s"
        rec.evidence = (f"SIGKILL at {kill['t_s']:.1f} s (exit {kill['returncode']}); "
                        f"{'standby ' if kill.get('standby') else ''}driver pid {attached.pid}{connected}, "
                        f"attached at {attached.t_s:.1f} s at step {attached.step}")
        before = [s.step for s in state.steps if s.t_s <= kill["t_s"]]
        rec.restore_s = round(rec.restore_s + attached.t_s - kill["t_s"], 2)
        if first is not None:
            rec.replay_s = round(rec.replay_s + first.t_s - attached.t_s, 2)
        # Steps the killed driver saw done that the owners did not keep (none: they hold their state).
        rec.steps_lost += max(0, (max(before) if before else 0) - attached.step)


def inner(args: argparse.Namespace) -> None:
    """In the head's namespace, the supervisor: the S3 server, the training drivers (one after
    another when ``driver_sigkill`` kills one), the accounting and the checks; prints one JSON line."""
    from benchmarks.harness.goodput import DEFINITION, goodput, pace_s, reference_step_s, shares
    from benchmarks.harness.s3_remote import serve
    import torch

    import zero_ray as zr
    from benchmarks.harness.soak_faults import KINDS, NOT_INJECTED, attribute
    from fit_order import reference_block_indices, token_windows
    from s3_server import S3Server
    from zero_ray.checkpoint.tools import inspect_checkpoint
    from zero_ray.models import lm_loss
    from zero_ray.testing import single_process

    work = tempfile.mkdtemp(prefix="zrsoak-run-")
    s3 = S3Server(host=args.head_ip, port=S3_PORT)
    bucket = s3.create_bucket("soak")
    tokens = _corpus()
    s3.put(bucket, "corpus/train-000.bin", tokens.tobytes())
    authkey = secrets.token_bytes(16)
    listener = serve(s3, os.path.join(work, "s3.sock"), authkey)
    kinds = args.kinds or ",".join(KINDS)
    spec = {"journal": os.path.join(work, "journal.jsonl"), "bucket": bucket, "nodes": NODES,
            "cpus_per_node": CPUS_PER_NODE, "health_timeout_s": args.health_timeout_s,
            "health_interval_s": args.health_interval_s, "detached": DRIVER_SIGKILL in kinds.split(","),
            "baseline_chunks": args.baseline_chunks, "minutes": args.minutes, "seed": args.seed,
            "fault_interval_s": args.fault_interval_s, "kinds": args.kinds, "far_ns": args.far_ns,
            "head_ip": args.head_ip, "far_ip": args.far_ip, "disk": args.disk, "netem": args.netem,
            "link_mbit": LINK_MBIT, "disk_leave_bytes": DISK_LEAVE_BYTES, "s3_socket": os.path.join(work, "s3.sock"),
            "s3_authkey": authkey.hex(), "calibrate_every_s": args.calibrate_every_s}
    spec_path = os.path.join(work, "spec.json")
    load_before: list[float] = []
    Path(spec_path).write_text(json.dumps(spec))
    try:
        state, kills = _supervise(spec, spec_path, deadline_s=args.minutes * 60 * 3 + 600,
                                  standby=spec["detached"] and args.standby_driver, load=load_before)
    finally:
        listener.close()
    end = state.end
    assert end is not None
    out: dict[str, Any] = {"not_injected": list(NOT_INJECTED), "baseline": state.baseline,
                           "baseline_recoveries": state.baseline_recoveries, "detached": spec["detached"],
                           "drivers": state.pids, "driver_kills": kills}
    before = {int(k): v["step_s"] for k, v in state.baseline.items()}
    # The reference: the baselines pooled with the calibrations interleaved with the soak.
    reference = reference_step_s({int(k): (v["steps"], v["s"]) for k, v in state.baseline.items()},
                                 state.calibrations)
    records = [FaultRecord(**state.faults[i]) for i in sorted(state.faults)]
    soak_s = end["soak_s"]
    attribute(records, state.recoveries, state.steps, soak_s, reference)
    _driver_kills(records, state, kills)
    parts = shares(state.steps, end_s=soak_s, baseline=reference)
    steps = len(state.steps)
    out["soak"] = {"s": soak_s, "steps": steps, "planned_faults": len(records),
                   "fault_free_s": round(sum(p.fault_free_s for p in parts), 2),
                   "load_before": load_before or end["load_before"], "load_after": end["load_after"],
                   "world_size_end": end["world_size_end"], "recoveries": len(state.recoveries)}
    out["by_size"] = [asdict(p) for p in parts]
    # The soak's own median pace at each size beside the baseline's: the load's drift under the faults.
    out["pace_ms"] = {str(p.size): round(1000 * v, 1) for p in parts if (v := pace_s(state.steps, p.size)) is not None}
    out["goodput"] = round(goodput(parts, wall_s=soak_s), 4)
    out["goodput_definition"] = DEFINITION
    out["reference_ms"] = {str(k): round(1000 * v, 1) for k, v in reference.items()}
    out["calibrations"] = [asdict(c) for c in state.calibrations]
    out["calibration_paused_s"] = round(state.paused_s, 2)
    # What the baselines before the soak alone would say (the first soaks' measure): the load's drift
    # over the soak charged to the faults.
    out["goodput_before_only"] = round(goodput(shares(state.steps, end_s=soak_s, baseline=before), wall_s=soak_s), 4)
    # The first soak's measure, kept to show what it overstated: every step at the 4-owner time.
    out["goodput_at_4_owner_time"] = round(steps * before[NODES * CPUS_PER_NODE] / soak_s, 4)
    out["faults"] = [asdict(r) for r in records]
    # Faults the run never settled for (soak_faults.Injector.overdue_s): the schedule stalled there.
    out["events"] = state.events
    out["missed_faults"] = [f"{r.kind} planned at {r.planned_s:g} s" for r in records if r.missed]
    out["samples_seen"] = end["samples_seen"]
    total = out["steps"] = end["steps_total"]
    got = torch.load(end["state"])
    committed = state.committed
    out["full_disk_reported_committed"] = [p for p, _ in committed if p.startswith(args.disk)]

    order = reference_block_indices(_block_sizes(tokens), global_batch_size=BATCH, steps=total, seed=SEED,
                                    window=WINDOW)
    out["epochs"] = _epochs(order, (len(tokens) - 1) // SEQ)
    out["samples_ok"] = out["samples_seen"] == total * BATCH
    t = time.perf_counter()
    ref, _ = single_process(gpt(), lm_loss, zr.SGD(lr=0.02), [token_windows(tokens, SEQ, idx) for idx in order])
    out["reference_s"] = round(time.perf_counter() - t, 1)
    out["dev"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    checks = []
    for path, step in committed:
        try:
            info = inspect_checkpoint(path, verify=True)
            ok = info["step"] == step and info["samples_seen"] == step * BATCH
            checks.append({"path": path, "step": step, "ok": ok})
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint is a result, reported by its error
            checks.append({"path": path, "step": step, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
    out["checkpoints"] = {"committed": len(checks), "verified": sum(c["ok"] for c in checks),
                          "failed": [c for c in checks if not c["ok"]]}
    s3.stop()
    print(json.dumps(out))


def _rest(faults: list[dict[str, Any]]) -> float:
    return sum(f["lost_s"] - f["detect_s"] - f["decide_s"] - f["restore_s"] - f["replay_s"] for f in faults)


def _calibrations_note(r: dict[str, Any]) -> str:
    """The reference beside the baselines: the calibrations interleaved with the soak, pooled."""
    cals = r.get("calibrations")
    if not cals:
        return ""
    valid = [c for c in cals if c["valid"]]
    by = {}
    for c in valid:
        by.setdefault(c["size"], []).append(1000 * c["s"] / c["steps"])
    return (f"; {len(valid)} fault-free calibration chunks interleaved with the soak ({len(cals) - len(valid)} "
            f"not used: a recovery landed in their round), ms a step by owners (range): "
            + ", ".join(f"{n}: {min(v):.0f}-{max(v):.0f} ({len(v)})" for n, v in sorted(by.items(), reverse=True))
            + "; the reference, both pooled: " + ", ".join(f"{k}: {v:.0f}" for k, v in r["reference_ms"].items())
            + f". Against the baselines before the soak alone, goodput {100 * r['goodput_before_only']:.1f}%")


def _drivers_note(r: dict[str, Any]) -> str:
    if not r.get("detached"):
        return ""
    return " (detached run" + (", each new driver started ahead" if r.get("standby_driver") else "") + ")"


def markdown(r: dict[str, Any]) -> str:
    """The results' table: faults by kind with time lost, goodput, samples and checkpoints."""
    soak, base = r["soak"], r["baseline"]
    lines = [f"# Soak: {r['minutes']:g} min at one fault every {r['fault_interval_s']:g} s (seed {r['seed']}, kinds: "
             f"{r.get('kinds', 'all')})", "",
             f"{r['machine']}. {r['cluster']}; health_timeout_s {r.get('health_timeout_s', 12):g}, health_interval_s "
             f"{r.get('health_interval_s', 3):g}. Recoveries during the soak: {soak['recoveries']}"
             f" (before it: {r.get('baseline_recoveries', 0)}).", "",
             f"**Goodput {100 * r['goodput']:.1f}%** ({r.get('goodput_definition', '')}): {soak['steps']} steps in "
             f"{soak['s']:.0f} s; fault-free at the sizes they were taken at they take {soak['fault_free_s']:.0f} s. "
             f"Fault-free ms a step by owners (baselines of the same run, before the soak): "
             + ", ".join(f"{k}: {v['step_s'] * 1000:.0f} ({v['steps']} steps)"
                        for k, v in sorted(base.items(), key=lambda kv: -int(kv[0])))
             + _calibrations_note(r)
             + f". Every step at the 4-owner time of the baselines would say "
             f"{100 * r.get('goodput_at_4_owner_time', 0):.1f}%. "
             f"Load average {soak['load_before'][0]:.1f} before, {soak['load_after'][0]:.1f} after"
             f"{' (' + soak['load_note'] + ')' if soak.get('load_note') else ''}."
             + (" The soak's own median ms a step (steps under 1 s apart at one size, checkpoints' steps among "
                "them): " + ", ".join(f"{k}: {v:.0f}" for k, v in r["pace_ms"].items())
                + " (against the baselines above: the load's drift, in every fault's slower steps)."
                if r.get("pace_ms") else ""), "",
             "| owners | steps | wall s | fault-free ms a step | fault-free s |", "|---|---|---|---|---|"]
    lines += [f"| {p['size']} | {p['steps']} | {p['s']:.0f} | {p['fault_free_step_s'] * 1000:.0f}"
              f"{'' if p['measured'] else ' (not measured: the fastest size)'} | {p['fault_free_s']:.0f} |"
              for p in r.get("by_size", [])]
    lines += [
             "", "Time lost is each fault's window less the fault-free time of its steps; `rest` is what the "
             "recoveries' phases do not cover (steps on fewer owners, the grow back's transfer, a slow link, "
             "the load's drift). The last four columns split the time lost by the window's step times "
             "(harness/goodput.window_parts): gaps over 1 s with no step, the pause before the first step at a "
             "larger size, steps on fewer owners than the window began with, and the other steps' excess (the "
             "fault's own slowness and the load's drift).", "",
             "| kind | fired | held s | detect s | decide s | restore s | replay s | steps lost | time lost s | rest s "
             "| stall s | grow back s | fewer owners s | slower steps s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds: dict[str, list[dict[str, Any]]] = {}
    for f in r["faults"]:
        kinds.setdefault(f["kind"], []).append(f)
    for kind, fs in sorted(kinds.items()):
        def tot(key: str, fs: list[dict[str, Any]] = fs) -> str:
            return f"{sum(f[key] for f in fs):.1f}"
        lines.append(f"| {kind} | {sum(f['fired'] for f in fs)}/{len(fs)} | {tot('held_s')} | {tot('detect_s')} | "
                     f"{tot('decide_s')} | {tot('restore_s')} | {tot('replay_s')} | "
                     f"{sum(f['steps_lost'] for f in fs)} | {tot('lost_s')} | {_rest(fs):.1f} | "
                     + " | ".join(tot(k) if all(k in f for f in fs) else "-"
                                  for k in ("stall_s", "grow_s", "smaller_s", "slow_s")) + " |")
    ep, ck = r["epochs"], r["checkpoints"]
    lines += ["", f"Final weights vs one process on the documented order: max |diff| {r['dev']:.2e} "
              f"({'within' if r['dev'] <= 1e-6 else 'OVER'} 1e-6). Samples read {r['samples_seen']} = "
              f"{r['steps']} steps x {BATCH} ({'ok' if r['samples_ok'] else 'MISMATCH'}); {ep['complete_epochs']} "
              f"complete epochs, each {ep['per_epoch']} distinct samples of {ep['samples']}; epochs reading a "
              f"sample twice: {ep['epochs_reading_a_sample_twice'] or 'none'}. Checkpoints committed "
              f"{ck['committed']}, verified {ck['verified']}.",
              f"A refused full-disk save reported committed: {r.get('full_disk_reported_committed') or 'none'}.",
              f"**Missed faults** (held past 3 intervals, never fired): {'; '.join(r['missed_faults'])}."
              if r.get("missed_faults") else "Missed faults: none (every planned fault fired in time).",
              f"Not injected: {', '.join(r['not_injected']) or 'none'}. Drivers: {len(r.get('drivers', [])) or 1}"
              f"{_drivers_note(r)}.",
              "", "Each fault:", ""]
    lines += [f"- {f['at_s']:.0f} s, step {f['at_step']}: {f['kind']} ({f['target']}); {f['evidence']}; "
              f"lost {f['lost_s']:.1f} s over {f['window_steps']} steps"
              + ("" if f.get("invariant_ok") is None else f"; nothing visible: {f['invariant_ok']}")
              + (f"; {' | '.join(f['recoveries'])}" if f["recoveries"] else "") for f in r["faults"]]
    return "\n".join(lines) + "\n"


def outer(args: argparse.Namespace) -> None:
    from benchmarks.harness.full_disk import mount_tmpfs, unmount
    from benchmarks.harness.simcluster import SUBNET, SimCluster, available, netem_available
    from s3_server import ACCESS_KEY, REGION, SECRET_KEY

    why = available()
    if why is not None:
        raise SystemExit(f"no simulated cluster here: {why}")
    head_ip = f"{SUBNET}.1"
    s3_env = {"AWS_ENDPOINT_URL": f"http://{head_ip}:{S3_PORT}", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
              "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}
    netem = netem_available()
    # Mounted before the nodes start: each node's namespace (``ip netns exec``) copies the mount table.
    disk = f"/tmp/zrsoak-disk-{os.getpid()}"
    mount_tmpfs(disk, size_bytes=DISK_BYTES)
    try:
        with SimCluster(nodes=NODES, cpus_per_node=CPUS_PER_NODE, link_mbit=LINK_MBIT, delay_ms=0.0,
                        ray_env=s3_env) as cluster:
            assert cluster.members[0].ip == head_ip
            far = cluster.members[1]
            argv = [sys.executable, "-m", "benchmarks.soak", "--inner", far.namespace, head_ip, far.ip, disk,
                    "--minutes", f"{args.minutes:g}", "--seed", str(args.seed), "--fault-interval-s",
                    f"{args.fault_interval_s:g}", "--baseline-chunks", str(args.baseline_chunks),
                    "--health-timeout-s", f"{args.health_timeout_s:g}",
                    "--health-interval-s", f"{args.health_interval_s:g}",
                    "--calibrate-every-s", f"{args.calibrate_every_s:g}",
                    "--standby-driver" if args.standby_driver else "--no-standby-driver"]
            argv += ["--kinds", args.kinds] if args.kinds else []
            got = cluster.run_in_head(argv + (["--netem"] if netem else []), timeout_s=args.minutes * 60 * 3 + 900,
                                      cwd=str(REPO), extra_env={"PYTHONPATH": str(REPO)})
            link = cluster.link
    finally:
        unmount(disk)
    if got.returncode != 0:
        raise SystemExit(f"the soak failed ({got.returncode}):\n{got.stderr[-6000:]}")
    r = json.loads(got.stdout.strip().splitlines()[-1])
    if r.get("missed_faults"):
        print(f"SOAK SCHEDULE STALLED: {len(r['missed_faults'])} faults missed: {r['missed_faults']}", file=sys.stderr)
    r.update(health_timeout_s=args.health_timeout_s, health_interval_s=args.health_interval_s,
             standby_driver=args.standby_driver)
    r.update(minutes=args.minutes, seed=args.seed, fault_interval_s=args.fault_interval_s, kinds=args.kinds or "all",
             machine=f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}",
             cluster=f"{NODES} simulated nodes x {CPUS_PER_NODE} CPUs, link {link}; stage 2, 4 owners, peer redundancy")
    path = Path(args.json)
    path.write_text(json.dumps(r, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--fault-interval-s", type=float, default=60.0)
    ap.add_argument("--baseline-chunks", type=int, default=2, help=f"fault-free chunks of {CHUNK} steps")
    ap.add_argument("--calibrate-every-s", type=float, default=CALIBRATE_EVERY_S,
                    help=f"soak seconds between fault-free calibration chunks of {CHUNK} steps (0: none)")
    ap.add_argument("--kinds", default="", help="comma-separated fault kinds to draw from (default: all; "
                    "benchmarks/harness/soak_faults.py KINDS)")
    ap.add_argument("--health-timeout-s", type=float, default=HEALTH_TIMEOUT_S,
                    help="ZeroConfig.health_timeout_s (a frozen owner or a long cut's far side is lost after it)")
    ap.add_argument("--health-interval-s", type=float, default=HEALTH_INTERVAL_S, help="ZeroConfig.health_interval_s")
    ap.add_argument("--standby-driver", action=argparse.BooleanOptionalAction, default=False,
                    help="driver_sigkill: hand the run to a driver started ahead (imported, connected to Ray)")
    ap.add_argument("--json", default=str(RESULTS / "soak.json"), help="where the results go (.md beside it)")
    ap.add_argument("--render", metavar="JSON", help="write the Markdown of a results file again, nothing run")
    ap.add_argument("--inner", nargs=4, metavar=("FAR_NS", "HEAD_IP", "FAR_IP", "DISK"), help=argparse.SUPPRESS)
    ap.add_argument("--netem", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
    elif args.inner:
        args.far_ns, args.head_ip, args.far_ip, args.disk = args.inner
        inner(args)
    else:
        outer(args)


if __name__ == "__main__":
    main()
