"""Simulated partition owners for ``benchmarks.control_scale``: the real owner control server
(``ControlServer`` + ``OwnerControl`` + the job's token and header checks) over a stand-in host
whose engine answers a step after a fixed compute time.

Many owners share one worker process (one server each, on its own port and thread pool, as a
``PartitionOwner`` serves); the driver talks to each over its own channel as it would to an
actor. A worker is driven over a ``multiprocessing`` pipe: it reports its servers' addresses,
then answers commands ("usage", "hold", "entered", "stop") until stopped.

The stand-in reports its compute window in fields of the real ``StepResult`` (all owners share
this machine's monotonic clock): ``totals.loss_sum`` is when its step began and ``grad_norm``
when it ended, so the driver can split a step's wall time into dispatch, compute and collection.
"""

from __future__ import annotations

import enum
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

from zero_ray.collective.flight_recorder import FlightRecorder
from zero_ray.control import handlers as h
from zero_ray.control.auth import Credentials
from zero_ray.control.client_channel import ClientConfig
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.server import ControlServer, ServerConfig
from zero_ray.core.run_position import Position
from zero_ray.errors import CollectiveError
from zero_ray.owner.resilience.checkpointing import ShardSaver
from zero_ray.owner.service.owner_control import OwnerControl, OwnerPlace
from zero_ray.owner.service.batch_source import PieceSource
from zero_ray.owner.resilience.redundancy import PeerSnapshots

CONTROL_THREADS, CONTROL_STREAMS = 32, 12  # as zero_ray/owner/service/actor.py
DATASET = "sim"
HOLD_LIMIT_S = 60.0  # a held step ends by itself after this, so a failed measurement never hangs


class _Phase(enum.Enum):
    IDLE = "idle"
    COMPUTING = "computing"


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """What every simulated owner of a run shares."""

    world_size: int
    job_id: str
    token: str
    compute_s: float
    # The compute window in loss_sum and grad_norm (control_scale splits a step's time with it);
    # False: a grad norm every rank agrees on, as a relay's combining checks (benchmarks.relay_hop).
    timestamps: bool = True


class SimEngine:
    """The stand-in for ``OwnerEngine``: a step waits ``compute_s`` (or, while held, until
    aborted: a step blocked in a collective on a dead peer) and answers."""

    def __init__(self, rank: int, compute_s: float, *, timestamps: bool = True) -> None:
        self.rank = rank
        self.compute_s = compute_s
        self.timestamps = timestamps
        self.phase = _Phase.IDLE
        self.position = Position(step=0, samples_seen=0)
        self.hold = False
        self.entered = False  # a held step is under way
        self.steps = 0
        self.aborted = threading.Event()

    def step(self, piece: Any, *, global_samples: int, position: Position) -> h.StepResult:
        started = time.monotonic()
        self.phase = _Phase.COMPUTING
        try:
            if self.hold:
                self.entered = True
                if self.aborted.wait(HOLD_LIMIT_S):
                    raise CollectiveError(f"rank {self.rank}: the step's collective was aborted")
            else:
                time.sleep(self.compute_s)
        finally:
            self.phase = _Phase.IDLE
        ended = time.monotonic()
        self.steps += 1
        self.position = Position(step=position.step + 1, samples_seen=position.samples_seen + global_samples)
        # The compute window, or a loss of its own and the norm every rank shares.
        loss_sum, norm = (started, ended) if self.timestamps else (float(self.rank), 1.0)
        return h.StepResult(totals=h.LossTotals(loss_sum=loss_sum, samples=1, items=1.0), grad_norm=norm,
                            skipped=False, loss_scale=1.0, compute_seconds=ended - started, rank=self.rank)


class SimHost:
    """The stand-in for the ``LiveRank`` an owner's ``OwnerControl`` is given (and its
    ``DriverContact``, counting touches): the real snapshot book-keeping, piece source, flight
    recorder and step lock; membership operations are not simulated."""

    def __init__(self, rank: int, settings: SimSettings) -> None:
        self.rank = rank
        self.world_size = settings.world_size
        self.generation = 0
        self.saver = ShardSaver()
        self.snapshots = PeerSnapshots()
        self.data = PieceSource()
        self.data.register(DATASET, [float(r) for r in range(settings.world_size)], factory=False, collate=None)
        self.step_lock = threading.Lock()
        self.flight = FlightRecorder()
        self.snapshot_every = 0  # as LiveRank's: no peer snapshots, so steps never call after_step
        self.touches = 0  # every control call and heartbeat served
        self.aborts = 0  # Abort calls taken (each survivor's once, after the loss)
        self.last_beat = 0.0  # when a heartbeat (or Stats) last read engine_or_none
        self.max_beat_gap = 0.0  # the longest time between two, since the driver last asked
        self._engine = SimEngine(rank, settings.compute_s, timestamps=settings.timestamps)

    @property
    def engine(self) -> SimEngine:  # type: ignore[override]
        return self._engine

    @property
    def engine_or_none(self) -> None:
        # Read by heartbeats (and Stats), not by steps: so the gap between two reads is the
        # owner's side of a heartbeat stall.
        now = time.monotonic()
        if self.last_beat:
            self.max_beat_gap = max(self.max_beat_gap, now - self.last_beat)
        self.last_beat = now
        # As an owner between setups: Stats and heartbeats answer without model state to report.
        return None

    def abort(self, *, reason: str, generation: int) -> bool:
        self.aborts += 1
        self._engine.aborted.set()
        return True

    def after_step(self, step: int) -> None:
        pass

    def touch(self) -> None:
        self.touches += 1

    def release(self) -> None:
        pass

    def _membership(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("membership operations are not simulated")

    setup = reform = set_peers = snapshot_info = resize_info = reshard = rebuild = _membership


def _usage(hosts: list[SimHost]) -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    steps = sum(x.engine.steps for x in hosts)
    gap = max(x.max_beat_gap for x in hosts)
    for x in hosts:
        x.max_beat_gap = 0.0
    return {"touches": sum(x.touches for x in hosts), "steps": steps, "cpu_s": ru.ru_utime + ru.ru_stime,
            "max_beat_gap": gap}


def _serve(host: SimHost, credentials: Credentials) -> tuple[ControlServer, RelayHost]:
    """One owner's control server over ``host``, as ``PartitionOwner`` builds its own: its
    owner service, and the relays the driver's tree has it host (``HostRelays``)."""
    server = ControlServer(ServerConfig(host="127.0.0.1", credentials=credentials, threads=CONTROL_THREADS,
                                        max_streams=CONTROL_STREAMS))
    server.add_owner(OwnerControl(host, contact=host, server=server,  # type: ignore[arg-type]
                                  place=OwnerPlace(node_id="sim", host="localhost", ip="127.0.0.1", pid=0),
                                  detached=False, fetch_timeout_s=30.0, save_timeout_s=30.0, ahead_timeout_s=30.0))
    relays = RelayHost(rank=host.rank, template=ClientConfig(address="127.0.0.1:1", credentials=credentials,
                                                             timeout_s=30.0))
    server.add_relay(relays)
    server.start()
    return server, relays


def worker_main(conn: Any, ranks: list[int], settings: SimSettings) -> None:
    """A worker process: serve ``ranks``' owners on loopback, send their addresses, then answer
    the driver's commands until "stop"."""
    credentials = Credentials(job_id=settings.job_id, token=settings.token)
    hosts = [SimHost(r, settings) for r in ranks]
    served = [_serve(host, credentials) for host in hosts]
    servers = [s for s, _ in served]
    conn.send([s.address for s in servers])
    while True:
        command = conn.recv()
        if command == "usage":
            conn.send(_usage(hosts))
        elif command == "hold":
            for x in hosts:
                x.engine.hold = True
            conn.send(True)
        elif command == "entered":
            conn.send(sum(x.engine.entered for x in hosts))
        elif command == "aborted":
            conn.send(sum(x.aborts for x in hosts))
        elif command == "stop":
            for s, relays in served:
                s.stop(0.0)
                relays.close()
            conn.send(True)
            return
