"""The soak's faults (benchmarks/soak.py): a seeded schedule of kinds and times, the injector that
fires each one into a live ``ZeroTrainer`` on the simulated cluster, and the typed record of
what each did. Injection reuses what the tests and harness already have: SIGKILL / SIGSTOP of
an owner's process (tests/faults.py's signals, by the pid its ``node`` call reports),
``simcluster.cut_link`` / ``restore_link`` / ``shape_link``, ``simcluster.kill_node`` and
``start_node`` (a node lost whole, then started again), a filled tmpfs (harness/full_disk.py), and
tests/s3_server.py's injected S3 errors (armed through harness/s3_remote.py: the S3 server lives
in the supervisor), and for ``driver_sigkill`` the supervisor's SIGKILL of the driver this runs
in (asked through the journal, harness/soak_journal.py); nothing here is known to the library.

A fault fires only when the one before it has settled (its link restored, the run back at its
size), so each fault's time lost is its own; the delay is recorded (``held_s``). One held past
``overdue_s`` is recorded as missed (``fired`` False, ``missed`` True, the evidence saying what had not
settled) and the schedule goes on: a stalled schedule shows in the results, never as silence
(the 30-minute soak of 2026-12-07 fired nothing for its last 17 minutes and said so nowhere)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.full_disk import fill, visible
from benchmarks.harness.goodput import StepAt, window_fault_free_s, window_parts
from benchmarks.harness.simcluster import (GCS_PORT, cut_link, kill_node, link_shape, reachable, restore_link,
                                           shape_link, start_node)
from benchmarks.harness.soak_journal import Recovered

OWNER_SIGKILL = "owner_sigkill"
OWNER_SIGSTOP = "owner_sigstop"
LINK_CUT_SHORT = "link_cut_short"  # shorter than health_timeout_s: ridden through
LINK_CUT_LONG = "link_cut_long"  # longer than collective_timeout_s: the far side is lost, then grows back
DEGRADED_LINK = "degraded_link"  # the far node's link slowed (rate, and delay where netem exists)
RESIZE = "resize"
S3_READ_ERRORS = "s3_read_errors"  # 503 SlowDown on the corpus' GETs: the readers' retries ride them
S3_SAVE_ERRORS = "s3_save_errors"  # 503 SlowDown on a save's PUTs: the uploads' retries ride them
NODE_KILLED = "node_killed"  # every process of the far node SIGKILLed; its Ray started again once dead
FULL_DISK = "full_disk"  # a save to a local disk with no room: refused, never visible, the run goes on
# The training driver SIGKILLed by the soak's supervisor mid-chunk; a new driver attaches to the
# detached owners and goes on, as a Ray job's retry would.
DRIVER_SIGKILL = "driver_sigkill"
KINDS = (OWNER_SIGKILL, OWNER_SIGSTOP, LINK_CUT_SHORT, LINK_CUT_LONG, DEGRADED_LINK, RESIZE, S3_READ_ERRORS,
         S3_SAVE_ERRORS, NODE_KILLED, FULL_DISK, DRIVER_SIGKILL)
NOT_INJECTED: tuple[str, ...] = ()  # every kind issue 46 asks for is injected
S3_ERRORS = 3  # each S3 error fault answers this many requests with 503 SlowDown


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One fault of the schedule: when (seconds into the soak) and what."""

    at_s: float
    kind: str


def schedule(*, seed: int, duration_s: float, interval_s: float, kinds: tuple[str, ...] = KINDS) -> list[Planned]:
    """About one fault every ``interval_s`` (each time jittered by up to a quarter interval), the
    kinds drawn from shuffled rounds of ``kinds`` so that every kind comes up once a round."""
    rng = random.Random(seed)
    out: list[Planned] = []
    bag: list[str] = []
    k = 1
    while (at := k * interval_s + rng.uniform(-0.25, 0.25) * interval_s) < duration_s - interval_s / 2:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        out.append(Planned(at_s=round(at, 1), kind=bag.pop()))
        k += 1
    return out


@dataclass(kw_only=True)
class FaultRecord:
    """What one fault did. Times are seconds; ``at_s`` from the soak's start. ``detect_s``,
    ``decide_s`` (the abort and the policy's decision: RecoveryReport.abort_s), ``restore_s``,
    ``replay_s`` and ``steps_lost`` (steps replayed) sum the recoveries that followed it;
    ``lost_s`` is its window's wall time (until the next fault) less the fault-free time of the
    steps taken in it."""

    kind: str
    planned_s: float
    at_s: float = 0.0
    held_s: float = 0.0  # fired this much after its planned time (the fault before had not settled)
    at_step: int = 0
    target: str = ""
    fired: bool = False
    evidence: str = ""
    recoveries: list[str] = field(default_factory=list)
    detect_s: float = 0.0
    decide_s: float = 0.0
    restore_s: float = 0.0
    replay_s: float = 0.0
    steps_lost: int = 0
    window_s: float = 0.0
    window_steps: int = 0
    lost_s: float = 0.0
    settled_s: float | None = None  # from firing until the run was back at its size and links
    missed: bool = False  # held past the injector's overdue_s: never fired
    # lost_s split by the window's step times (goodput.window_parts): no step, a grow back's pause,
    # steps on fewer owners, slower steps at the window's size
    stall_s: float = 0.0
    grow_s: float = 0.0
    smaller_s: float = 0.0
    slow_s: float = 0.0
    invariant_ok: bool | None = None  # full_disk: the refused save left nothing visible


@dataclass(kw_only=True)
class Cluster:
    """What the injector touches outside the trainer: the far node's namespace, the head's
    address, the S3 server and the corpus / checkpoint key patterns."""

    far_namespace: str
    head_ip: str
    s3: Any  # tests/s3_server.S3Server
    corpus_pattern: str
    checkpoint_pattern: str
    link_mbit: float
    netem: bool
    far_ip: str
    cpus_per_node: int
    disk: str  # a small tmpfs every node sees (mounted before the nodes started): the full disk
    disk_leave_bytes: int


class Injector:
    """Fires the planned faults from fit's callback (between steps) and keeps their records."""

    trainer: Any
    cluster: Cluster
    rng: random.Random
    sizes: tuple[int, ...]
    short_cut_s: float
    long_cut_s: float
    degrade_s: float
    records: list[FaultRecord]
    pending: list[Planned]
    _timers: list[threading.Thread]
    _unsettled: list[Callable[[], bool]]
    _stack: ExitStack
    _rules: list[tuple[FaultRecord, Any]]  # S3 error rules armed, with the record each fired for
    _size: int  # the size the run should be at: a fault fires only once it is back there
    overdue_s: float  # a fault held this long past its planned time is recorded as missed
    kill_requested: bool  # driver_sigkill fired: this driver waits for its supervisor's SIGKILL

    def __init__(self, trainer: Any, cluster: Cluster, plan: list[Planned], *, seed: int, sizes: tuple[int, ...],
                 short_cut_s: float, long_cut_s: float, degrade_s: float, overdue_s: float) -> None:
        self.trainer, self.cluster, self.rng, self.sizes = trainer, cluster, random.Random(seed + 1), sizes
        self.overdue_s = overdue_s
        self.short_cut_s, self.long_cut_s, self.degrade_s = short_cut_s, long_cut_s, degrade_s
        self.records, self.pending = [], list(plan)
        self._timers, self._unsettled, self._stack, self._rules = [], [], ExitStack(), []
        self._size, self.kill_requested = trainer.world_size, False

    @property
    def size(self) -> int:
        return self._size

    def resume(self, records: list[FaultRecord], size: int) -> None:
        """Go on where a SIGKILLed driver's injector stood (its records, from the journal): the
        faults it fired are not planned again, and the run is kept at its size."""
        self.records, self.pending, self._size = list(records), self.pending[len(records):], size

    # -- called between steps ---------------------------------------------------------------------
    def tick(self, elapsed_s: float, step: int) -> None:
        """Fire the next fault if it is due and the last one has settled."""
        settled = self._settled()
        self._note_settled(elapsed_s, settled)
        if not self.pending or elapsed_s < self.pending[0].at_s:
            return
        if not settled:
            if elapsed_s - self.pending[0].at_s > self.overdue_s:
                self.records.append(self._missed(self.pending.pop(0), elapsed_s, step))
            return
        planned = self.pending.pop(0)
        rec = FaultRecord(kind=planned.kind, planned_s=planned.at_s, at_s=round(elapsed_s, 2),
                          held_s=round(elapsed_s - planned.at_s, 2), at_step=step)
        self._end_rules()  # an S3 error rule from the fault before ends here
        self._stack = ExitStack()
        getattr(self, f"_{planned.kind}")(rec)
        self.records.append(rec)

    def _missed(self, planned: Planned, elapsed_s: float, step: int) -> FaultRecord:
        """The record of a fault the run never settled for: what was still unsettled."""
        return FaultRecord(kind=planned.kind, planned_s=planned.at_s, at_s=round(elapsed_s, 2),
                           held_s=round(elapsed_s - planned.at_s, 2), at_step=step, missed=True,
                           evidence=f"missed: held over {self.overdue_s:g} s, the run at {self.trainer.world_size} "
                                    f"owners (the injector keeps {self._size}), {len(self._unsettled)} unsettled "
                                    "checks (a link, a process, a node)")

    def quiet(self, elapsed_s: float, *, for_s: float = 0.0) -> bool:
        """Nothing of a fault is still in flight, and has not been for ``for_s`` soak seconds: no
        kill asked, no timer running (a cut or a degraded link still to restore, a node still to
        start again), every S3 error rule spent, the run back at its size with every check settled
        at least ``for_s`` before ``elapsed_s``. The soak's calibrations run only then: what
        follows a fault's settling (a replacement's first steps, the survivors' catching up) is
        the fault's time, not the fault-free reference."""
        if (self.kill_requested or any(t.is_alive() for t in self._timers)
                or not all(rule.hits >= S3_ERRORS for _, rule in self._rules) or not self._settled()):
            return False
        self._note_settled(elapsed_s, True)  # settled since the last tick: from now
        if not self.records:
            return True
        last = self.records[-1]
        assert last.settled_s is not None
        return elapsed_s - (last.at_s + last.settled_s) >= for_s

    def _note_settled(self, elapsed_s: float, settled: bool) -> None:
        """The last fault's ``settled_s``, the first time it is seen ``settled``."""
        if settled and self.records and self.records[-1].settled_s is None:
            self.records[-1].settled_s = round(elapsed_s - self.records[-1].at_s, 2)

    def _end_rules(self) -> None:
        for rec, rule in self._rules:
            rec.fired, rec.evidence = rule.hits > 0, rec.evidence + f"; {rule.hits} errors answered"
        self._rules = []
        self._stack.close()

    def _settled(self) -> bool:
        self._unsettled = [check for check in self._unsettled if not check()]
        return not self._unsettled and self.trainer.world_size == self._size

    def close(self) -> None:
        for t in self._timers:
            t.join(timeout=120)
        self._end_rules()
        restore_link(self.cluster.far_namespace)
        shape_link(self.cluster.far_namespace, mbit=self.cluster.link_mbit, delay_ms=0.0, netem=self.cluster.netem)

    # -- the faults ---------------------------------------------------------------------------------
    def _owner(self) -> tuple[int, int]:
        import ray  # here, so that the schedule is read without Ray (tests/unit/test_bench_soak.py)

        rank = self.rng.randrange(self.trainer.world_size)
        return rank, int(ray.get(self.trainer.actors[rank].node.remote(), timeout=60)["pid"])

    def _signal(self, rec: FaultRecord, sig: signal.Signals) -> None:
        rank, pid = self._owner()
        rec.target = f"rank {rank} of {self.trainer.world_size} (pid {pid})"
        os.kill(pid, sig)
        gone = threading.Event()

        def ended() -> bool:  # the owner's process is gone (the run SIGKILLs a frozen one itself)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.set()
            return gone.is_set()

        self._unsettled.append(ended)
        rec.fired, rec.evidence = True, f"{sig.name} delivered to pid {pid}"

    def _owner_sigkill(self, rec: FaultRecord) -> None:
        self._signal(rec, signal.SIGKILL)

    def _owner_sigstop(self, rec: FaultRecord) -> None:
        self._signal(rec, signal.SIGSTOP)

    def _cut(self, rec: FaultRecord, seconds: float) -> None:
        ns = self.cluster.far_namespace
        cut_link(ns)
        rec.target = f"node 1's link for {seconds:g}s"
        rec.fired = not reachable(ns, self.cluster.head_ip, GCS_PORT, timeout_s=1.0)
        restored = threading.Event()

        def restore() -> None:
            restore_link(ns)
            restored.set()

        timer = threading.Timer(max(0.0, seconds - 1.0), restore)  # the probe above took about a second
        timer.start()
        self._timers.append(timer)
        self._unsettled.append(restored.is_set)
        rec.evidence = "a probe across the link " + ("failed" if rec.fired else "opened") + " during the cut"

    def _link_cut_short(self, rec: FaultRecord) -> None:
        self._cut(rec, self.short_cut_s)

    def _link_cut_long(self, rec: FaultRecord) -> None:
        self._cut(rec, self.long_cut_s)

    def _degraded_link(self, rec: FaultRecord) -> None:
        ns, mbit = self.cluster.far_namespace, self.cluster.link_mbit / 50
        delay = 20.0 if self.cluster.netem else 0.0
        shape_link(ns, mbit=mbit, delay_ms=delay, netem=self.cluster.netem)
        rec.target = f"node 1's link at {mbit:g} Mbit/s, {delay:g} ms for {self.degrade_s:g}s"
        shown = link_shape(ns)
        rec.fired, rec.evidence = f"rate {mbit:g}Mbit" in shown, f"tc: {shown}"
        done = threading.Event()

        def back() -> None:
            shape_link(ns, mbit=self.cluster.link_mbit, delay_ms=0.0, netem=self.cluster.netem)
            done.set()

        timer = threading.Timer(self.degrade_s, back)
        timer.start()
        self._timers.append(timer)
        self._unsettled.append(done.is_set)

    def _resize(self, rec: FaultRecord) -> None:
        size = next(s for s in self.sizes if s != self.trainer.world_size)
        before = self.trainer.world_size
        self.trainer.resize(size)
        self._size = self.trainer.world_size
        rec.target = f"{before} -> {size} owners"
        rec.fired, rec.evidence = self._size == size, f"world size {self._size} after the resize"

    def _s3_errors(self, rec: FaultRecord, pattern: str, methods: tuple[str, ...], what: str) -> Any:
        rule = self._stack.enter_context(self.cluster.s3.failing(pattern, count=S3_ERRORS, methods=methods))
        rec.target = f"{S3_ERRORS} x 503 SlowDown on {what}"
        self._rules.append((rec, rule))
        return rule

    def _s3_read_errors(self, rec: FaultRecord) -> None:
        self._s3_errors(rec, self.cluster.corpus_pattern, ("GET",), "the corpus' reads")
        # The errors answer the next reads that reach the store (the owners' block caches are
        # smaller than the corpus); the rule's hits are read when the next fault fires.
        rec.evidence = "rule armed until the next fault"

    def _s3_save_errors(self, rec: FaultRecord) -> None:
        self._s3_errors(rec, self.cluster.checkpoint_pattern, ("PUT", "POST"), "a save's uploads")
        rec.evidence = f"{self.trainer.save_checkpoint(wait=True)} committed"

    def _node_killed(self, rec: FaultRecord) -> None:
        """SIGKILL every process of the far node (its raylet, Ray workers, owners), as a machine
        that dies; then what a node's supervisor (KubeRay, systemd) does: once Ray's GCS has
        declared the node dead, ``ray start`` there again, so the run can grow back."""
        import ray

        ns, ip = self.cluster.far_namespace, self.cluster.far_ip
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip]
        t0 = time.monotonic()
        pids = kill_node(ns)
        deadline = t0 + 30
        while time.monotonic() < deadline and [p for p in pids if _running(p)]:
            time.sleep(0.05)
        left = [p for p in pids if _running(p)]
        rec.target = f"node 1 ({ip}: {len(pids)} processes, {len(node_ids)} Ray node)"
        rec.fired = bool(pids) and bool(node_ids) and not left
        rec.evidence = f"SIGKILL to {len(pids)} processes, {len(left)} still running"
        back = threading.Event()

        def supervisor() -> None:
            try:
                while time.monotonic() - t0 < 180 and any(
                        n["Alive"] for n in ray.nodes() if n["NodeID"] in node_ids):
                    time.sleep(0.5)
                dead_s = time.monotonic() - t0
                env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
                start_node(ns, ip=ip, address=f"{self.cluster.head_ip}:{GCS_PORT}", cpus=self.cluster.cpus_per_node,
                           env=env, log=f"/tmp/zrsoak-{os.getpid()}-restart.log")
                rec.evidence += f"; Ray declared it dead after {dead_s:.1f} s, started there again"
            finally:
                back.set()

        thread = threading.Thread(target=supervisor, name="soak-node-supervisor", daemon=True)
        thread.start()
        self._timers.append(thread)
        self._unsettled.append(back.is_set)

    def _driver_sigkill(self, rec: FaultRecord) -> None:
        """Ask the supervisor (through the journal) to SIGKILL this driver process; fit goes on
        meanwhile, so the kill lands mid-chunk. The supervisor starts a driver that attaches to
        the detached owners and reads this record back (``resume``); ``fired`` is set by the
        supervisor once the process is gone and the new driver attached."""
        rec.target = f"the training driver (pid {os.getpid()})"
        rec.evidence = "SIGKILL asked of the supervisor"
        self.kill_requested = True

    def _full_disk(self, rec: FaultRecord) -> None:
        """A save to a local checkpoint root on a disk with no room left (the run's own
        checkpoints go on to S3): refused with a CheckpointError, nothing of it visible (no
        committed checkpoint, ``latest`` unchanged, no unfinished directory), the run going on."""
        from zero_ray.errors import CheckpointError

        root = os.path.join(self.cluster.disk, "run")
        filler = fill(self.cluster.disk, leave_bytes=self.cluster.disk_leave_bytes)
        before = visible(root)
        rec.target = f"a save to {root} with {self.cluster.disk_leave_bytes >> 10} KiB free"
        try:
            got = self.trainer.save_checkpoint(root, wait=True)
            rec.evidence = f"the save committed {got}: the disk was not full"
        except CheckpointError as err:
            after = visible(root)
            rec.fired = "No space left on device" in str(err)
            rec.invariant_ok = after == before
            rec.evidence = (f"CheckpointError ({'ENOSPC' if rec.fired else str(err)[:200]}); visible after: "
                            f"{len(after.committed)} committed, latest {after.latest}, others {list(after.others)}")
        finally:
            filler.unlink()


def attribute(records: list[FaultRecord], reports: list[Recovered], step_times: list[StepAt], end_s: float,
              baseline: dict[int, float]) -> None:
    """Each record's recoveries (those whose failed step is at or after its firing and before the
    next fault's) and its window's time lost, each step valued at its own size's fault-free time
    (``baseline``: seconds a step by world size); ``step_times``: every soak step as reported."""
    for i, rec in enumerate(records):
        until = records[i + 1].at_step if i + 1 < len(records) else None
        mine = [r for r in reports if r.failed_step >= rec.at_step and (until is None or r.failed_step < until)]
        rec.recoveries = [r.summary for r in mine]
        rec.detect_s = round(sum(r.detect_s for r in mine), 2)
        rec.decide_s = round(sum(r.abort_s for r in mine), 2)
        rec.restore_s = round(sum(r.restore_s for r in mine), 2)
        rec.replay_s = round(sum(max(r.replay_s, 0.0) for r in mine), 2)
        rec.steps_lost = sum(r.replayed_steps for r in mine)
        end = records[i + 1].at_s if i + 1 < len(records) else end_s
        steps = [s for s in step_times if rec.at_s < s.t_s <= end]
        rec.window_s = round(end - rec.at_s, 2)
        rec.window_steps = len(steps)
        rec.lost_s = round(rec.window_s - window_fault_free_s(steps, baseline), 2)
        before = [s for s in step_times if s.t_s <= rec.at_s]
        start = before[-1] if before else (steps[0] if steps else None)
        if start is not None:
            parts = window_parts(steps, start_s=rec.at_s, end_s=end, size=start.size,
                                 before_s=before[-1].t_s if before else rec.at_s, baseline=baseline)
            rec.stall_s, rec.grow_s, rec.smaller_s, rec.slow_s = parts.stall_s, parts.grow_s, parts.smaller_s, parts.slow_s


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process whose parent was killed too may stay one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"
