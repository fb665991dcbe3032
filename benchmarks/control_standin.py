"""Stand-in subtrees for ``benchmarks.control_scale --stand-in``: the driver's side of the relay
tree measured at 1,024 and 8,192 owners on one machine.

The driver only ever talks to the top relays (2 at 1,024 and at 8,192 owners with fan-out 8 and
8 owners a node; 4 at 256). So the top relays are real: each a ``ControlServer`` in its own
process serving the real ``RelayHost`` and ``RelayHop`` (token checks, request and reply
conversions, the combining, the ``Relay.Watch`` feed reading its children's streams). What stands
in is everything below them: each child of a top relay (a relay one level down, with its whole
subtree) is a :class:`StandInSubtrees` server that answers ``RelayStep`` with the combined reply
its ranks would send (built once, at start, by the real ``core/reply_combine`` over one
``StepResult`` per rank: the same size and fields; ``data_seconds`` and ``compute_seconds`` carry
when it began and ended the step, on the machine's monotonic clock), ``--compute-ms`` after the step may begin
(after the one before it on that subtree: a step sent ahead waits, as ``StepOrder`` makes an
owner wait), and answers ``Relay.Watch`` with every rank's beat once, then an empty message each
interval (what an idle relay sends), and ``Relay.RelayCall`` of ``Abort`` (the survivors' abort
after the loss, ``RelayPlane.abort``; also for the relays inside the victim's subtree that live
ranks host, as they would) with every rank's reply, and ``PartitionOwner.Abort`` (a survivor the
lost relay called itself), counting the ranks the abort reached.
``HostRelays`` is answered and ignored: the stand-ins serve whatever the driver's plan names.

The driver (``RelayPlane`` + ``SubtreeHealthMonitor``, unchanged) plans the whole tree and tells
every hosting rank what to serve; the ranks that host a top relay are the real servers, which
keep only their top relay and send its child it hosts itself to the stand-ins (what
:class:`TopRelayHost` changes, and only at planning). The last top relay's last child is alone in
its own process: the victim of the loss measurement, its SIGKILL a relay's.

Not measured here: the relays below the top (each node's relay: ``benchmarks/relay_hop.py``) and
the owners; compose them (driver + depth x hop + node) as docs/performance.md does.
"""

from __future__ import annotations

import dataclasses
import resource
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc

from benchmarks.harness.worker_fleet import WorkerFleet, helper_context, recv
from zero_ray.control import handlers as h
from zero_ray.control._generated import owner_pb2, owner_pb2_grpc, relay_pb2, relay_pb2_grpc
from zero_ray.control.auth import Credentials
from zero_ray.control.client import RelayClient
from zero_ray.control.client_channel import ClientConfig
from zero_ray.control.conversion import to_message
from zero_ray.control.heap_freeze import freeze_heap
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.relay_wire import to_wire
from zero_ray.control.server import ControlServer, ServerConfig
from zero_ray.core.relay_tree import RelayConfig, RelayTree, plan_relays
from zero_ray.core.reply_combine import CombinedReplies, CombinedStep, combine_steps

START_TIMEOUT_S = 300.0
HOLD_LIMIT_S = 60.0  # a held step ends by itself after this, so a failed measurement never hangs
STUB_THREADS = 256  # every Watch stream holds a thread, and two steps per subtree may be in flight


def combined_reply(ranks: Sequence[int]) -> CombinedStep:
    """What a subtree over ``ranks`` answers a step with: each rank's result (a loss of its own,
    the norm all share) combined by the real combining, as the relays below would."""
    return combine_steps(CombinedStep.of(h.StepResult(
        totals=h.LossTotals(loss_sum=float(r), samples=1, items=1.0), grad_norm=1.0, skipped=False, loss_scale=1.0,
        compute_seconds=0.0, rank=r)) for r in ranks)


class StandInSubtrees(relay_pb2_grpc.RelayServicer):
    """The relays one stand-in process serves, by relay id: each a whole subtree answering at
    once (after the compute time) with its precomputed combined reply."""

    _replies: dict[int, relay_pb2.RelayStepReply]
    _ranks: dict[int, tuple[int, ...]]
    _compute_s: float
    _busy_until: dict[int, float]  # per relay: when its last step ends (a step sent ahead waits for it)
    _lock: threading.Lock
    hold: bool
    released: threading.Event
    entered: int  # ranks inside held steps
    steps: int
    messages: int  # Watch messages sent
    aborted: int  # ranks an Abort reached through RelayCall (the survivors' after the loss)

    def __init__(self, subtrees: Mapping[int, Sequence[int]], *, compute_s: float,
                 below: Mapping[int, Sequence[int]] | None = None) -> None:
        self._ranks = {relay: tuple(ranks) for relay, ranks in subtrees.items()}
        # Every relay a RelayCall may name here: the subtrees', and the relays inside them that
        # live ranks host (an abort routed around the lost relay calls them: RelayPlane.abort).
        self._callable = {**{relay: tuple(ranks) for relay, ranks in (below or {}).items()}, **self._ranks}
        self._replies = {relay: to_message(to_wire(combined_reply(ranks)), relay_pb2.RelayStepReply)
                         for relay, ranks in self._ranks.items()}
        self._compute_s = compute_s
        self._busy_until = dict.fromkeys(self._ranks, 0.0)
        self._lock = threading.Lock()
        self.hold, self.released, self.entered, self.steps, self.messages = False, threading.Event(), 0, 0, 0
        self.aborted = 0

    def RelayStep(self, request: relay_pb2.RelayStepRequest, context: grpc.ServicerContext) -> Any:
        relay = request.relay
        if relay not in self._replies:
            context.abort(grpc.StatusCode.NOT_FOUND, f"the stand-in serves relays {sorted(self._replies)}, not {relay}")
        if self.hold:  # as owners blocked in a collective on a dead peer
            with self._lock:
                self.entered += len(self._ranks[relay])
            self.released.wait(HOLD_LIMIT_S)
            context.abort(grpc.StatusCode.ABORTED, "the stand-in's held step was released")
        with self._lock:
            start = max(time.monotonic(), self._busy_until[relay])
            end = self._busy_until[relay] = start + self._compute_s
        time.sleep(max(0.0, end - time.monotonic()))
        with self._lock:
            self.steps += 1
        # When this subtree began and ended the step (this machine's monotonic clock, which the
        # driver shares), in fields the top relay combines as maxima: the driver splits its wait
        # into dispatch, compute and collection with them, as control_sim's owners let it.
        reply = relay_pb2.RelayStepReply()
        reply.CopyFrom(self._replies[relay])
        reply.data_seconds, reply.compute_seconds = start, time.monotonic()
        return reply

    def RelayCall(self, request: relay_pb2.RelayCallRequest, context: grpc.ServicerContext) -> Any:
        """``Abort`` on every rank of the subtree (``RelayPlane.abort``, the survivors' after the
        loss), answered per rank as the owners below would; other forwarded calls are not stood in."""
        relay = request.relay
        if relay not in self._callable:
            context.abort(grpc.StatusCode.NOT_FOUND, f"the stand-in serves relays {sorted(self._ranks)}, not {relay}")
        if request.method != "Abort":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the stand-in forwards Abort only, not {request.method}")
        ranks = self._callable[relay]
        asked = [r for span in request.ranks for r in range(span.start, span.stop)]
        if asked != list(ranks):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"relay {relay}'s subtree is ranks {ranks[0]}-{ranks[-1]}")
        reply = owner_pb2.AbortReply(aborted=True).SerializeToString()
        with self._lock:
            self.aborted += len(ranks)
        return relay_pb2.RelayCallReply(replies=[relay_pb2.RankReply(rank=r, reply=reply) for r in ranks])

    def abort_one(self) -> None:
        """An owner's Abort called directly (a rank the lost relay called itself)."""
        with self._lock:
            self.aborted += 1

    def HostRelays(self, request: relay_pb2.HostRelaysRequest, context: grpc.ServicerContext) -> Any:
        return relay_pb2.HostRelaysReply(relays=sorted(r.relay for r in request.relays))

    def Watch(self, request: relay_pb2.WatchRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        ranks = self._ranks.get(request.relay, ())
        interval_s = max(request.interval_ms, 10) / 1e3
        yield relay_pb2.SubtreeBeats(beats=[owner_pb2.Heartbeat(rank=r, step=0, state="idle", timestamp=time.time(),
                                                                rss_bytes=1 << 30) for r in ranks])
        while context.is_active():
            time.sleep(interval_s)
            with self._lock:
                self.messages += 1
            yield relay_pb2.SubtreeBeats()


class StandInOwners(owner_pb2_grpc.PartitionOwnerServicer):
    """The owners of the stand-in subtrees as far as the driver calls them directly: Abort only
    (the survivors a lost relay called itself), counted with the relayed ones."""

    def __init__(self, subtrees: StandInSubtrees) -> None:
        self._subtrees = subtrees

    def Abort(self, request: owner_pb2.AbortRequest, context: grpc.ServicerContext) -> Any:
        self._subtrees.abort_one()
        return owner_pb2.AbortReply(aborted=True)


def stub_main(conn: Any, subtrees: dict[int, tuple[int, ...]], compute_s: float,
              below: dict[int, tuple[int, ...]] | None = None) -> None:
    """A stand-in process: serve ``subtrees`` (relay id -> its ranks) on loopback, send the
    address, then answer "usage", "hold", "entered", "aborted", "release", "stop"."""
    freeze_heap()  # at its start, as the owners' processes it stands in for do (PartitionOwner)
    servicer = StandInSubtrees(subtrees, compute_s=compute_s, below=below)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=STUB_THREADS))
    relay_pb2_grpc.add_RelayServicer_to_server(servicer, server)
    owner_pb2_grpc.add_PartitionOwnerServicer_to_server(StandInOwners(servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send([f"127.0.0.1:{port}"])
    while True:
        command = conn.recv()
        if command == "usage":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            conn.send({"touches": servicer.messages + servicer.steps, "steps": servicer.steps,
                       "cpu_s": ru.ru_utime + ru.ru_stime, "max_beat_gap": 0.0})
        elif command == "hold":
            servicer.hold = True
            conn.send(True)
        elif command == "entered":
            conn.send(servicer.entered)
        elif command == "aborted":
            conn.send(servicer.aborted)
        elif command == "release":
            servicer.released.set()
            conn.send(True)
        elif command == "stop":
            servicer.released.set()
            server.stop(0.0)
            conn.send(True)
            return


class TopRelayHost(RelayHost):
    """The real ``RelayHost`` of a process hosting a top relay, told at planning to serve only
    its top relays (``keep``), its children that the plan puts in this process (``own`` address)
    sent to the stand-ins (``stand_in``) instead. Every call after planning is RelayHost's own."""

    _keep: frozenset[int]
    own: str
    _stand_in: str
    _below: RelayClient | None  # the stand-ins', for a relay below the top this process would serve

    def __init__(self, *, rank: int, template: ClientConfig, keep: frozenset[int], stand_in: str) -> None:
        super().__init__(rank=rank, template=template)
        self._keep = keep
        self.own = ""  # the server's address, set once it listens
        self._stand_in = stand_in
        self._below = None

    def host_relays(self, args: h.HostRelaysArgs) -> h.HostRelaysResult:
        def seat(s: h.RelayChildSeat) -> h.RelayChildSeat:
            return dataclasses.replace(s, address=self._stand_in) if s.address == self.own else s

        kept = tuple(dataclasses.replace(r, children=tuple(seat(s) for s in r.children))
                     for r in args.relays if r.relay in self._keep)
        return super().host_relays(dataclasses.replace(args, relays=kept))

    def relay_call(self, args: h.RelayCallArgs) -> CombinedReplies:
        """A relay this process would serve below its top one (the driver calls one directly to
        abort around a lost relay: ``RelayPlane.abort``) is the stand-ins': forwarded to them."""
        if args.relay in self._keep:
            return super().relay_call(args)
        with self._lock:
            if self._below is None:
                self._below = RelayClient(dataclasses.replace(self._template, address=self._stand_in))
            below = self._below
        return below.relay_call(args, timeout_s=args.timeout_s)

    def close(self) -> None:
        with self._lock:
            below, self._below = self._below, None
        if below is not None:
            below.close()
        super().close()


def top_main(conn: Any, rank: int, keep: frozenset[int], stand_in: str, job_id: str, token: str) -> None:
    """A top relay's process: the real relay server (``ControlServer`` + :class:`TopRelayHost`),
    until "stop"; "usage" answers its CPU seconds."""
    freeze_heap()  # at its start, as an owner's process hosting a top relay does (PartitionOwner)
    credentials = Credentials(job_id=job_id, token=token)
    template = ClientConfig(address="127.0.0.1:1", credentials=credentials, timeout_s=60.0)
    host = TopRelayHost(rank=rank, template=template, keep=keep, stand_in=stand_in)
    server = ControlServer(ServerConfig(host="127.0.0.1", credentials=credentials, threads=32, max_streams=12))
    server.add_relay(host)
    host.own = server.start()
    conn.send([host.own])
    while True:
        command = conn.recv()
        if command == "usage":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            conn.send({"touches": 0, "steps": 0, "cpu_s": ru.ru_utime + ru.ru_stime, "max_beat_gap": 0.0})
        elif command in ("hold", "release"):
            conn.send(True)
        elif command in ("entered", "aborted"):  # its subtrees' stand-ins count them
            conn.send(0)
        elif command == "stop":
            server.stop(0.0)
            host.close()
            conn.send(True)
            return


def stand_in_tree(owners: int, *, fan_out: int, owners_per_node: int) -> RelayTree:
    """The tree the driver will plan over ``owners`` simulated owners (``Driver``'s node ids)."""
    return plan_relays([f"sim-{r // owners_per_node}" for r in range(owners)],
                       RelayConfig(fan_out=fan_out, min_owners=1))


class StandInCluster(WorkerFleet):
    """The processes of a stand-in run, with ``SimCluster``'s interface: the top relays' real
    servers (first), the stand-ins for every other subtree, and the victim stand-in alone (last);
    ``addresses`` by rank as the driver's members name them."""

    credentials: Credentials
    tree: RelayTree
    conns: list[Any]
    procs: list[Any]
    addresses: list[str]
    victim_rank: int  # the host rank of the victim's relay: the rank its SIGKILL loses
    tops: int

    def __init__(self, owners: int, *, fan_out: int, owners_per_node: int, compute_s: float) -> None:
        self.credentials = Credentials(job_id=f"control-scale-{owners}", token=secrets.token_urlsafe(32))
        self.tree = tree = stand_in_tree(owners, fan_out=fan_out, owners_per_node=owners_per_node)
        top = tree.driver_children
        if top[0].ranks:
            raise ValueError(f"{owners} owners: the top relays are node relays (depth 1), whose children are owners; "
                             "nothing stands in: measure the full simulation")
        below = [c for t in top for c in tree.children(t.id)]
        victim = below[-1]
        self.victim_rank = victim.host
        ctx = helper_context()
        self.conns, self.procs = [], []

        def start(target: Any, *args: Any) -> str:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, *args), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
            return recv(parent, START_TIMEOUT_S, "address")[0]

        # The stand-ins first (the tops need their address), then moved behind the tops.
        # The shared stand-in also answers an abort for the relays inside the victim's subtree
        # that live ranks host: only the victim's host rank is lost (its relays with it).
        inside = {r.id: tree.ranks_under(r.id) for r in tree.relays
                  if r.host != victim.host and r.id not in {t.id for t in top}}
        shared = start(stub_main, {c.id: tree.ranks_under(c.id) for c in below[:-1]}, compute_s, inside)
        lone = start(stub_main, {victim.id: tree.ranks_under(victim.id)}, compute_s)
        hosts = {t.host: start(top_main, t.host, frozenset(x.id for x in top if x.host == t.host), shared,
                               self.credentials.job_id, self.credentials.token) for t in top}
        self.conns, self.procs = self.conns[2:] + self.conns[:2], self.procs[2:] + self.procs[:2]
        self.tops = len(hosts)
        self.addresses = [hosts.get(r, lone if r == victim.host else shared) for r in range(owners)]

    def top_cpu_s(self) -> float:
        """The top relays' processes' CPU seconds so far."""
        return sum(u["cpu_s"] for u in [self._ask_one(c, "usage") for c in self.conns[:self.tops]])

    @staticmethod
    def _ask_one(conn: Any, command: str) -> Any:
        conn.send(command)
        return recv(conn, 60.0, command)
