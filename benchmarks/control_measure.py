"""One measurement of ``benchmarks.control_scale``: N simulated owners (``benchmarks.control_sim``)
in worker processes, the driver's real control path over them (``OwnerClient`` per owner,
``FanOut`` for the step, ``HealthMonitor``'s heartbeat streams at the run's default interval),
and the figures of one row.

The victim of the loss measurement, the last rank, is alone in its own worker process, so that
SIGKILL ends exactly one owner, as a dead actor's process does.
"""

from __future__ import annotations

import os
import re
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.control_sim import DATASET, SimSettings, worker_main
from benchmarks.control_standin import StandInCluster, stand_in_tree
from benchmarks.harness.worker_fleet import WorkerFleet, helper_context, recv
from zero_ray.control._generated import owner_pb2
from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient
from zero_ray.control.handlers import StepArgs
from zero_ray.control.rank_watch import RankHealthWatch, SubtreeHealthMonitor
from zero_ray.core.relay_tree import RelayConfig
from zero_ray.driver.batch_staging import IndexedBatch, StepCommand
from zero_ray.driver.fanout import FanOut, Members
from zero_ray.driver.health import HealthMonitor
from zero_ray.driver.relay_plane import RelayPlane
from zero_ray.errors import OwnerLostError, ZeroRayError

START_TIMEOUT_S = 300.0  # workers import torch (OwnerControl's module does): slow on a busy machine
STEP_TIMEOUT_S = 60.0
LATE_MS = 1.0  # a pipelined step that began later than this after the one before ended was late


@dataclass(frozen=True, kw_only=True)
class ScaleSettings:
    """How one row is measured."""

    compute_s: float
    steps: int
    warmup: int
    per_process: int
    heartbeat_window_s: float
    health_interval_s: float
    health_timeout_s: float
    probe_calls: int
    relay_fan_out: int = 0  # steps down a relay tree of this fan-out (0: to every owner directly)
    owners_per_node: int = 8  # the simulated nodes the tree is planned over
    # The top relays real, every subtree below them stood in (benchmarks/control_standin.py)
    stand_in: bool = False


@dataclass(frozen=True, kw_only=True)
class ScaleRow:
    """One owner count's figures (medians over the timed steps where per step)."""

    owners: int
    driver_added_ms_per_step: float  # step wall time minus the fixed compute time
    driver_cpu_cores: float  # the driver process's CPU seconds / wall seconds over the timed steps
    heartbeat_cpu_cores: float  # the driver's CPU with heartbeats only, less its idle CPU
    loss_to_decision_s: float  # SIGKILL of one owner's process -> FanOut raising OwnerLostError
    step_wall_ms: float
    dispatch_ms: float  # the step's start on the driver -> the last owner began computing
    compute_ms: float  # the first owner began -> the last owner ended (stand-ins: the last began)
    collect_ms: float  # the last owner ended -> the fan-out returned on the driver
    driver_cpu_ms_per_step: float
    driver_cpu_us_per_owner: float
    grpc_call_cpu_us: float  # one Stats call from one thread, CPU on the driver
    pool_handoff_cpu_us: float  # one no-op task through a thread pool and back, CPU on the driver
    stats_fanout_ms: float  # Stats on every owner at once (the shape of benchmarks.control_overhead)
    driver_threads: int
    heartbeats_per_s: float
    heartbeat_bytes_per_s: float  # protobuf payload only (no HTTP/2 or TCP framing)
    owners_heartbeat_cpu_cores: float  # the worker processes' CPU over the heartbeat window
    health_detect_s: float  # SIGKILL -> the HealthMonitor reporting the owner lost
    # the decision -> every survivor's Abort answered (FanOut.check begins it, FanOut.abort waits for
    # it and completes it); before issue 44's abort fix, a second abort after the check's own
    abort_survivors_s: float
    lost_rank_ok: bool  # the decision named the killed owner
    max_beat_age_s: float  # the oldest last heartbeat the monitor held after a timed step
    owners_max_beat_gap_s: float  # the longest an owner went without serving a heartbeat, over the steps
    false_losses: int  # live owners the monitor declared lost during the timed steps (each restarts it)
    false_loss_reason: str  # the first one's
    heartbeat_cpu_by_thread: dict[str, float]  # cores, over the heartbeat window, by thread group
    step_cpu_by_thread: dict[str, float]  # ms per timed step, by thread group
    # fit's path: each step sent while the one before runs; wall per step less the compute time
    pipelined_added_ms_per_step: float = float("nan")
    pipelined_cpu_cores: float = float("nan")
    # Stand-in rows: the pipelined steps that began on a subtree more than LATE_MS after the step
    # before ended there (their command arrived late), and the time they lost together (-1, NaN:
    # not known, the simulated owners say nothing of it)
    pipelined_late_steps: int = -1
    pipelined_late_ms: float = float("nan")
    # the relay tree (0: steps went to every owner directly; dispatch / compute / collect are then NaN)
    relay_fan_out: int = 0
    relay_depth: int = 0
    owners_per_node: int = 0
    # what ran below the driver: "simulated owners" (every owner a real server over a stand-in
    # engine, every relay real) or "stand-in subtrees" (the top relays real, below them stood in)
    below_driver: str = "simulated owners"
    top_relays: int = 0
    top_relays_cpu_ms_per_step: float = float("nan")  # the top relays' processes, stand-in rows only
    loadavg: tuple[float, float] = (float("nan"), float("nan"))  # 1-minute load at the row's start and end
    # the Abort calls the survivors took (stand-ins: through the tree only; they refuse a direct one)
    aborted_ranks: int = -1

    def as_json(self) -> dict[str, Any]:
        """The row as JSON-ready numbers."""
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ScaleRow:
        """A row :meth:`as_json` wrote."""
        return cls(**{**row, "loadavg": tuple(row.get("loadavg", (float("nan"),) * 2))})


class SimCluster(WorkerFleet):
    """The worker processes hosting N simulated owners, and their addresses in rank order."""

    def __init__(self, owners: int, settings: ScaleSettings) -> None:
        self.credentials = Credentials(job_id=f"control-scale-{owners}", token=secrets.token_urlsafe(32))
        # A relay checks that every rank reports the same grad norm: no compute window in it then.
        sim = SimSettings(world_size=owners, job_id=self.credentials.job_id, token=self.credentials.token,
                          compute_s=settings.compute_s, timestamps=not settings.relay_fan_out)
        survivors = list(range(owners - 1))
        chunks = [survivors[i:i + settings.per_process] for i in range(0, len(survivors), settings.per_process)]
        chunks.append([owners - 1])  # the victim, alone
        ctx = helper_context()
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for ranks in chunks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, ranks, sim), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.addresses = [a for conn in self.conns for a in recv(conn, START_TIMEOUT_S, "addresses")]
        self.victim_rank = owners - 1


def _wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held, polling; TimeoutError past ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s")
        time.sleep(poll_s)
    return time.monotonic() - start


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each of this process's threads so far (the scheduler's nanosecond count,
    /proc/.../schedstat), by kernel thread id, with its group: the Python thread's name less
    its number (``zero_ray-health-3`` -> ``zero_ray-health``), or the kernel's name for threads
    Python did not start (gRPC core's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                on_cpu_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        name = names.get(int(tid))
        group = re.sub(r"[-_]\d+$", "", name) if name else f"native: {comm}"
        out[int(tid)] = (group, on_cpu_ns / 1e9)
    return out


def cpu_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group between two :func:`thread_cpu` readings (a thread that ended
    meanwhile is missing; one that began counts whole)."""
    groups: dict[str, float] = {}
    for tid, (group, cpu) in after.items():
        groups[group] = groups.get(group, 0.0) + cpu - before.get(tid, (group, 0.0))[1]
    return {g: round(v, 4) for g, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v > 0}


def _cpu_us_per(count: int, fn: Callable[[], Any]) -> float:
    c0 = time.process_time()
    for _ in range(count):
        fn()
    return (time.process_time() - c0) / count * 1e6


def _step_args(step: int, owners: int, *, ahead: bool = False) -> StepCommand:
    """Step ``step``: rank r reads sample r of the stand-ins' dataset (the controller's command)."""
    out = IndexedBatch(dataset=DATASET, indices=tuple(range(owners))).split(world_size=owners, key=f"0:{step}")
    return StepCommand(step=StepArgs(step=step, piece=out.piece, global_samples=owners, generation=0,
                                     samples_seen=step * owners, ahead=ahead), out=out)


class Driver:
    """The driver's side: a client per owner, the health monitor and the fan-out, as
    ``OwnerPool`` builds them."""

    def __init__(self, cluster: SimCluster, settings: ScaleSettings) -> None:
        self.settings = settings
        self.owners = len(cluster.addresses)
        self.clients = [OwnerClient(ClientConfig(address=a, credentials=cluster.credentials, timeout_s=STEP_TIMEOUT_S))
                        for a in cluster.addresses]
        self.members = Members()  # what OwnerPool hands its FanOut: the clients, the monitor, the generation
        self.members.clients = self.clients
        per_node = settings.owners_per_node
        self.members.nodes = [{"node_id": f"sim-{r // per_node}", "control_address": a, "ip": "127.0.0.1", "pid": 0}
                              for r, a in enumerate(cluster.addresses)]
        self.fan = FanOut(world_size=self.owners, members=self.members)
        self.threads_seen = 0
        self.relays: RelayPlane | None = None
        if settings.relay_fan_out:  # as OwnerPool does from RelayConfig.min_owners on
            self.relays = RelayPlane(config=RelayConfig(fan_out=settings.relay_fan_out, min_owners=1),
                                     members=self.members, fan=self.fan,
                                     client_config=lambda address: ClientConfig(
                                         address=address, credentials=cluster.credentials, timeout_s=STEP_TIMEOUT_S))
            self.relays.replan()

    @property
    def monitor(self) -> RankHealthWatch | None:
        return self.members.health

    def start_monitor(self) -> None:
        """As ``OwnerPool._membership_changed``: the top relays' Watch streams on the tree, else
        every owner's Health stream."""
        s = self.settings
        monitor: RankHealthWatch = (
            SubtreeHealthMonitor(self.relays.top_children, interval_s=s.health_interval_s, timeout_s=s.health_timeout_s)
            if self.relays is not None else
            HealthMonitor(self.clients, interval_s=s.health_interval_s, timeout_s=s.health_timeout_s))
        self.members.watch(monitor)
        _wait_until(lambda: all(r.last_beat > 0 for r in monitor.snapshot()), START_TIMEOUT_S, 0.05,
                    "every heartbeat stream's first beat")

    def restart_monitor(self) -> None:
        """As ``OwnerPool._membership_changed``: a new monitor over every owner."""
        if self.monitor is not None:
            self.monitor.close()
        self.start_monitor()

    def beat_age_s(self) -> float:
        """How old the oldest owner's last heartbeat is."""
        assert self.monitor is not None
        now = time.time()
        return max(now - r.last_beat for r in self.monitor.snapshot())

    def abort(self, reason: str) -> None:
        """As ``OwnerPool.abort``: Abort on every owner the monitor has not lost, on the urgent pool."""
        self.fan.abort(reason)

    def _start(self, command: StepCommand) -> Any:
        # the paths OwnerPool.start_step takes: down the relay tree, or calls in gRPC's future
        # form to every owner (no pool thread per owner)
        if self.relays is not None:
            return self.relays.start_step(command, timeout_s=STEP_TIMEOUT_S, staged={})
        args = command.per_rank()
        return self.fan.start(self.clients, "step", lambda c, r: c.step_async(args[r], timeout_s=STEP_TIMEOUT_S))

    def _collect(self, flight: Any) -> list[Any]:
        if self.relays is not None:  # combined: a stand-in subtree's window in it (control_standin)
            return [self.relays.collect(flight)]
        return self.fan.collect(flight)

    def step(self, step: int) -> tuple[float, float, list[Any]]:
        """One step on every owner: (wall s, driver CPU s, [(start, replies)]: each owner's, or the tree's combined)."""
        t0, c0 = time.monotonic(), time.process_time()
        results = self._collect(self._start(_step_args(step, self.owners)))
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        self.threads_seen = max(self.threads_seen, threading.active_count())
        return wall, cpu, [(t0, results)]

    def pipelined(self, first: int, count: int) -> tuple[float, float, list[Any]]:
        """``count`` steps as ``fit`` runs them (``Controller.execute``): each sent while the one
        before runs (``StepArgs.ahead``), then the one before collected; (wall s, driver CPU s,
        each step's results)."""
        t0, c0 = time.monotonic(), time.process_time()
        replies = []
        flight = self._start(_step_args(first, self.owners))
        for k in range(first, first + count):
            following = self._start(_step_args(k + 1, self.owners, ahead=True)) if k + 1 < first + count else None
            replies.append(self._collect(flight))
            flight = following
        return time.monotonic() - t0, time.process_time() - c0, replies

    def stats_fanout_s(self, repeats: int) -> float:
        walls = []
        for _ in range(repeats):
            t0 = time.monotonic()
            self.fan.grpc(self.clients, "stats", lambda c, r: c.stats(timeout_s=10.0), watch=False)
            walls.append(time.monotonic() - t0)
        return statistics.median(walls)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.relays is not None:
            self.relays.close()
        self.fan.close()
        for c in self.clients:
            c.close()


def late_ms(replies: Sequence[Any], compute_s: float) -> list[float]:
    """Per pipelined step after the first, how long after the step before it ended it began on
    its last subtree (the stand-ins' reply says when: a step that arrived in time begins exactly
    as the one before ends, so 0): the time pipelining did not hide."""
    began = [reply.data_seconds for [reply] in replies]
    return [max(0.0, (b - a - compute_s) * 1e3) for a, b in zip(began, began[1:])]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _heartbeat_payload_bytes() -> int:
    beat = owner_pb2.Heartbeat(rank=1023, step=123456, state="starting", timestamp=time.time(),
                               rss_bytes=3 << 30)
    return beat.ByteSize()


def measure(owners: int, settings: ScaleSettings, log: Callable[[str], None] = print) -> ScaleRow:
    """Start ``owners`` simulated owners, measure one row, tear everything down."""
    if owners < 2:
        raise ValueError(f"owners={owners}: the loss measurement needs a survivor (at least 2)")
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    stand_in = settings.stand_in and settings.relay_fan_out and not stand_in_tree(
        owners, fan_out=settings.relay_fan_out, owners_per_node=settings.owners_per_node).driver_children[0].ranks
    cluster: SimCluster | StandInCluster = (
        StandInCluster(owners, fan_out=settings.relay_fan_out, owners_per_node=settings.owners_per_node,
                       compute_s=settings.compute_s) if stand_in else SimCluster(owners, settings))
    driver = Driver(cluster, settings)
    log(f"  {owners} owners up in {time.monotonic() - t_start:.1f} s ({len(cluster.procs)} processes)")
    try:
        window = settings.heartbeat_window_s
        c0 = time.process_time()
        time.sleep(window)  # the driver idle, no streams: its baseline
        idle_cpu = time.process_time() - c0
        driver.start_monitor()
        u0, c0, t0, th0 = cluster.usage(), time.process_time(), time.monotonic(), thread_cpu()
        time.sleep(window)  # heartbeats only: the window the figures are taken over
        beat_cpu, elapsed, th1 = time.process_time() - c0, time.monotonic() - t0, thread_cpu()
        u1 = cluster.usage()
        beat_threads = {g: round(v / elapsed, 5) for g, v in cpu_by_group(th0, th1).items()}
        beats = (u1["touches"] - u0["touches"]) - (u1["steps"] - u0["steps"])
        heartbeat_cpu_cores = max(0.0, beat_cpu - idle_cpu * elapsed / window) / elapsed
        owners_cpu = (u1["cpu_s"] - u0["cpu_s"]) / elapsed

        false_losses: list[str] = []
        lost = driver.monitor.lost() if driver.monitor is not None else {}
        if lost:  # every owner is alive: the monitor missed beats during the heartbeat window
            false_losses.append(f"{len(lost)} during the heartbeat window, e.g. {next(iter(lost.values()))}")
            log(f"  {false_losses[-1]}")
            driver.restart_monitor()
        stats_fanout_s = grpc_us = float("nan")  # stand-ins serve no owner: no Stats to time
        if not stand_in:
            try:
                stats_fanout_s = driver.stats_fanout_s(5)
            except ZeroRayError as err:  # reported, not fatal: the steps are what the row is about
                log(f"  the Stats fan-out failed: {err}")
                false_losses.append(f"the Stats fan-out failed: {err}")
            probe = driver.clients[: max(1, min(owners - 1, settings.probe_calls))]
            grpc_us = _cpu_us_per(len(probe), lambda it=iter(probe): next(it).stats(timeout_s=10.0))
        handoff_us = _cpu_us_per(settings.probe_calls, lambda: driver.fan.urgent({0: None}, lambda c: c,
                                                                                 timeout_s=10.0))
        walls, cpus, added, dispatch, compute, collect, ages = [], [], [], [], [], [], []
        k = 0
        cluster.usage()  # resets the owners' heartbeat gaps
        top0 = 0.0
        while len(walls) < settings.steps:
            if k == settings.warmup:
                th0 = thread_cpu()
                top0 = cluster.top_cpu_s() if isinstance(cluster, StandInCluster) else 0.0
            try:
                wall, cpu, [(t0, results)] = driver.step(k)
            except OwnerLostError as err:  # every owner is alive: the monitor missed their beats
                false_losses.append(str(err))
                log(f"  step {k}: a live owner was declared lost: {err}")
                if len(false_losses) > settings.steps // 2 + 2:
                    raise
                driver.restart_monitor()
                continue
            k += 1
            if k <= settings.warmup:
                continue
            ages.append(driver.beat_age_s())
            walls.append(wall)
            cpus.append(cpu)
            added.append(wall - settings.compute_s)
            if results and stand_in:  # the last subtree's start and end, maxima over the stand-ins
                [reply] = results
                dispatch.append(reply.data_seconds - t0)
                compute.append(reply.compute_seconds - reply.data_seconds)
                collect.append(t0 + wall - reply.compute_seconds)
            elif results and driver.relays is None:  # each owner's compute window
                t_end = t0 + wall
                starts, ends = [r.totals.loss_sum for r in results], [r.grad_norm for r in results]
                dispatch.append(max(starts) - t0)
                compute.append(max(ends) - min(starts))
                collect.append(t_end - max(ends))
        top_ms = ((cluster.top_cpu_s() - top0) * 1e3 / settings.steps if isinstance(cluster, StandInCluster)
                  else float("nan"))
        step_threads = {g: round(v * 1e3 / settings.steps, 3) for g, v in cpu_by_group(th0, thread_cpu()).items()}
        log(f"  steps: median wall {_median(walls) * 1e3:.1f} ms, CPU {_median(cpus) * 1e3:.1f} ms")
        piped_wall, piped_cpu, piped = driver.pipelined(k, settings.steps)
        late = late_ms(piped, settings.compute_s) if stand_in else []
        k += settings.steps
        log(f"  pipelined: {piped_wall / settings.steps * 1e3:.1f} ms a step, CPU {piped_cpu / piped_wall:.2f} cores")
        owner_gap = cluster.usage()["max_beat_gap"]
        loss = _loss(cluster, driver, k)
        cpu_ms = _median(cpus) * 1e3
        return ScaleRow(
            owners=owners, driver_added_ms_per_step=_median(added) * 1e3, driver_cpu_cores=sum(cpus) / sum(walls),
            heartbeat_cpu_cores=heartbeat_cpu_cores, loss_to_decision_s=loss["decision_s"],
            step_wall_ms=_median(walls) * 1e3, dispatch_ms=_median(dispatch) * 1e3, compute_ms=_median(compute) * 1e3,
            collect_ms=_median(collect) * 1e3, driver_cpu_ms_per_step=cpu_ms,
            driver_cpu_us_per_owner=cpu_ms * 1e3 / owners, grpc_call_cpu_us=grpc_us, pool_handoff_cpu_us=handoff_us,
            stats_fanout_ms=stats_fanout_s * 1e3, driver_threads=driver.threads_seen,
            heartbeats_per_s=beats / elapsed, heartbeat_bytes_per_s=beats / elapsed * _heartbeat_payload_bytes(),
            owners_heartbeat_cpu_cores=owners_cpu, health_detect_s=loss["health_s"],
            abort_survivors_s=loss["abort_s"], aborted_ranks=loss["aborted"], lost_rank_ok=loss["rank_ok"],
            heartbeat_cpu_by_thread=beat_threads,
            step_cpu_by_thread=step_threads, max_beat_age_s=max(ages), owners_max_beat_gap_s=owner_gap,
            false_losses=len(false_losses), false_loss_reason=false_losses[0] if false_losses else "",
            pipelined_added_ms_per_step=(piped_wall / settings.steps - settings.compute_s) * 1e3,
            pipelined_cpu_cores=piped_cpu / piped_wall, relay_fan_out=settings.relay_fan_out,
            pipelined_late_steps=sum(x > LATE_MS for x in late) if late else -1,
            pipelined_late_ms=sum(late) if late else float("nan"),
            relay_depth=driver.relays.tree.depth if driver.relays is not None and driver.relays.tree else 0,
            owners_per_node=settings.owners_per_node if settings.relay_fan_out else 0,
            below_driver="stand-in subtrees" if stand_in else "simulated owners",
            top_relays=len(driver.relays.top_children) if driver.relays is not None else 0,
            top_relays_cpu_ms_per_step=top_ms, loadavg=(load_start, os.getloadavg()[0]))
    finally:
        driver.close()
        cluster.stop()


def _loss(cluster: SimCluster | StandInCluster, driver: Driver, step: int) -> dict[str, Any]:
    """Kill the victim's process while every owner is inside a step (the survivors blocked as in
    a collective on it); time the monitor's detection, FanOut's OwnerLostError and the abort."""
    owners = driver.owners
    cluster.ask("hold")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            driver.step(step)
        except ZeroRayError as err:
            outcome["at"], outcome["error"] = time.monotonic(), err

    thread = threading.Thread(target=run, name="control-scale-loss-step", daemon=True)
    thread.start()
    _wait_until(lambda: sum(cluster.ask("entered")) == owners, 60.0, 0.01, "every owner inside the held step")
    monitor = driver.monitor
    assert monitor is not None
    victim = cluster.victim_rank
    killed = time.monotonic()
    cluster.victim.kill()  # SIGKILL, our own worker process
    health_s = _wait_until(lambda: victim in monitor.lost(), 60.0, 0.001, "the monitor losing the victim")
    thread.join(timeout=60.0)
    error = outcome.get("error")
    if error is None:
        raise TimeoutError("the step did not fail within 60 s of its owner's loss")
    # The decision began the survivors' abort (FanOut.check); the recovery's abort waits for it
    # and completes it: from the decision to every survivor having taken it.
    driver.abort("control_scale: an owner was lost")
    abort_s = time.monotonic() - outcome["at"]
    aborted = sum(cluster.ask("aborted", survivors_only=True))  # the Abort calls the survivors took
    if isinstance(cluster, StandInCluster):  # the stand-ins' held steps end
        cluster.ask("release", survivors_only=True)
    return {"decision_s": outcome["at"] - killed, "health_s": health_s, "abort_s": abort_s,
            "rank_ok": isinstance(error, OwnerLostError) and error.rank == victim, "aborted": aborted}
