"""Stand-in owners and a served relay tree for the relay-hop tests (in-process gRPC, no Ray).

Each owner is a real ``ControlServer`` over a :class:`StandInOwner`, whose step is a tiny
deterministic computation on its piece's indices; each relay of a ``plan_relays`` tree is a
``RelayHop`` served on a ``ControlServer`` of its own, its children's clients carrying the
run's credentials; the driver's hop over the top relays is called in process.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from control_fakes import WAIT_S, FakeOwner, server_config

from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient, RelayClient
from zero_ray.control.handlers import (
    EvaluateArgs,
    EvaluateResult,
    FailureContext,
    Heartbeat,
    LossTotals,
    OwnerStats,
    Piece,
    RelayEvaluateArgs,
    RelayStepArgs,
    StepArgs,
    StepResult,
)
from zero_ray.control.relay_hop import RelayHop, hop_children
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.server import ControlServer
from zero_ray.core.relay_tree import RelayConfig, RelayTree, plan_relays

MARGIN_S = 0.2  # each hop gives the relays below it this much less time than it has
WORLD = 8
NODES = tuple(f"node-{n}" for n in "abcd" for _ in range(2))  # two ranks a node: four node relays, two above them
PER_RANK = 4  # indices in each rank's piece


class StandInOwner(FakeOwner):
    """An owner whose step computes its reply from its piece: losses that are multiples of
    1/8 (``dyadic``: every sum exact in floats, so today's float sums equal the exact ones) or
    of 0.1 (sums that round differently in another order)."""

    def __init__(self, rank: int, *, dyadic: bool = True) -> None:
        super().__init__()
        self.rank = rank
        self.dyadic = dyadic
        self.beat_state = "idle"
        self.evaluations: list[EvaluateArgs] = []

    def evaluate(self, args: EvaluateArgs) -> EvaluateResult:
        """Its loss on its piece, as ``step_result`` computes a step's (``fail_with`` fails it)."""
        self.evaluations.append(args)
        if self.fail_with is not None:
            raise self.fail_with
        totals = self.step_result(StepArgs(step=0, piece=args.piece, global_samples=1)).totals
        return EvaluateResult(totals=totals, rank=self.rank)

    def stats(self) -> OwnerStats:
        """Counters of this rank's own (``fail_with`` fails them)."""
        self.calls.append("stats")
        if self.fail_with is not None:
            raise self.fail_with
        r = self.rank
        return OwnerStats(step=9, rank=r, world_size=8, stage=2, memory_bytes={"params": 100 * (r + 1)},
                          bytes_sent={"all_gather": 5 + r}, inside_node_bytes=r, cross_node_bytes=2 * r)

    def step_result(self, args: StepArgs) -> StepResult:
        indices = args.piece.indices
        unit = 0.125 if self.dyadic else 0.1
        loss_sum = sum(unit * (i % 7 + 1) for i in indices)
        items = float(3 * len(indices) + self.rank)
        r = self.rank
        return StepResult(totals=LossTotals(loss_sum=loss_sum, samples=len(indices), count=items, counted=True,
                                            items=items),
                          grad_norm=0.5 + args.step, lr=1 / 1024, skipped=False, loss_scale=65536.0,
                          compute_seconds=(r + 1) / 64, data_seconds=r / 128 if self.dyadic else r / 10, rank=r,
                          bytes_sent={"reduce_scatter": 1000 * (r + 1), "all_gather": 7 * r})

    def failure_context(self) -> FailureContext:
        return FailureContext(rank=self.rank, phase="computing")

    def heartbeat(self) -> Heartbeat:
        """A beat of this rank's own: its ``beat_state`` and an rss of ``rank + 1`` MiB, so that
        a watcher's view of each rank can be told apart (FakeOwner's hang_heartbeats still holds)."""
        beat = super().heartbeat()
        return dataclasses.replace(beat, rank=self.rank, state=self.beat_state, rss_bytes=(self.rank + 1) << 20)


def step_args(step: int, rank: int, world: int) -> StepArgs:
    """Rank ``rank``'s part of step ``step``: its own indices of the step's batch."""
    first = step * world * PER_RANK + rank * PER_RANK
    return StepArgs(step=step, piece=Piece(dataset="train", indices=tuple(range(first, first + PER_RANK))),
                    global_samples=world * PER_RANK, generation=1, samples_seen=step * world * PER_RANK)


def relay_args(step: int, world: int, timeout_s: float = WAIT_S, *, ranks: Sequence[int] | None = None,
               relay: int = 0) -> RelayStepArgs:
    """Step ``step`` for ``ranks`` (default: all ``world``), each rank's indices as ``step_args`` gives them."""
    ranks = range(world) if ranks is None else ranks
    per_rank = [step_args(step, r, world) for r in ranks]
    common = dataclasses.replace(per_rank[0], piece=Piece(dataset="train"))
    return RelayStepArgs.of(common, ranks=ranks, counts=[len(a.piece.indices) for a in per_rank],
                            indices=[i for a in per_rank for i in a.piece.indices], timeout_s=timeout_s, relay=relay)


def evaluate_args(rank: int, world: int, *, batch: int = 0) -> EvaluateArgs:
    """Rank ``rank``'s part of evaluation batch ``batch``: its own indices (``PER_RANK + rank`` of
    them, so that the ranks' counts differ)."""
    first = batch * 1000 + rank * 2 * PER_RANK
    return EvaluateArgs(piece=Piece(dataset="eval", indices=tuple(range(first, first + PER_RANK + rank))),
                        generation=1)


def relay_evaluate_args(world: int, timeout_s: float = WAIT_S, *, batch: int = 0,
                        ranks: Sequence[int] | None = None, relay: int = 0) -> RelayEvaluateArgs:
    """Evaluation batch ``batch`` for ``ranks`` (default: all ``world``), each rank's indices as
    ``evaluate_args`` gives them, packed."""
    ranks = range(world) if ranks is None else ranks
    per_rank = [evaluate_args(r, world, batch=batch) for r in ranks]
    return RelayEvaluateArgs.of(EvaluateArgs(piece=Piece(dataset="eval"), generation=1), ranks=ranks,
                                counts=[len(a.piece.indices) for a in per_rank],
                                indices=[i for a in per_rank for i in a.piece.indices], timeout_s=timeout_s,
                                relay=relay)


@dataclass(kw_only=True)
class ServedTree:
    """A relay tree served over loopback: the owners, every relay, the driver's hop."""

    tree: RelayTree
    credentials: Credentials
    owners: list[StandInOwner]
    owner_clients: dict[int, OwnerClient]
    relay_servers: dict[int, ControlServer]
    relay_clients: dict[int, RelayClient]
    driver: RelayHop
    servers: list[ControlServer] = field(default_factory=list)
    hops: list[RelayHop] = field(default_factory=list)  # every relay's and the driver's: close() ends their threads

    def client_config(self, server: ControlServer, credentials: Credentials | None = None) -> ClientConfig:
        return ClientConfig(address=server.address, credentials=credentials or self.credentials, timeout_s=WAIT_S)

    def reset(self) -> None:
        for owner in self.owners:
            owner.release_step.set()  # a step left blocked ends
            owner.fail_with, owner.block_steps = None, False
            owner.steps.clear()
            owner.evaluations.clear()
            owner.calls.clear()
            owner.aborts.clear()
            owner.step_entered.clear()
            owner.release_step = threading.Event()

    def close(self) -> None:
        for owner in self.owners:
            owner.release_step.set()
        for hop in self.hops:
            hop.close()
        for client in [*self.owner_clients.values(), *self.relay_clients.values()]:
            client.close()
        for server in self.servers:
            server.stop()


def serve_tree(credentials: Credentials, nodes: Sequence[str], fan_out: int, *, dyadic: bool = True) -> ServedTree:
    """Owners on ``nodes`` (rank r on ``nodes[r]``) under the relays of ``plan_relays``."""
    tree = plan_relays(nodes, RelayConfig(fan_out=fan_out))
    owners = [StandInOwner(r, dyadic=dyadic) for r in range(len(nodes))]
    servers: list[ControlServer] = []
    owner_clients: dict[int, OwnerClient] = {}
    for owner in owners:
        server = ControlServer(server_config(credentials))
        server.add_owner(owner)
        server.start()
        servers.append(server)
        owner_clients[owner.rank] = OwnerClient(ClientConfig(address=server.address, credentials=credentials,
                                                             timeout_s=WAIT_S))
    relay_servers: dict[int, ControlServer] = {}
    relay_clients: dict[int, RelayClient] = {}
    hops: list[RelayHop] = []
    for relay in sorted(tree.relays, key=lambda r: r.level):  # the lower relays first: the upper ones dial them
        hop = RelayHop(host=relay.host, children=hop_children(tree, relay.id, owners=owner_clients,
                                                              relays=relay_clients), margin_s=MARGIN_S)
        hops.append(hop)
        server = ControlServer(server_config(credentials))
        server.add_relay(RelayHost.serving({relay.id: hop}, rank=relay.host, template=ClientConfig(
            address="127.0.0.1:1", credentials=credentials, timeout_s=WAIT_S)))
        server.start()
        servers.append(server)
        relay_servers[relay.id] = server
        relay_clients[relay.id] = RelayClient(ClientConfig(address=server.address, credentials=credentials,
                                                           timeout_s=WAIT_S))
    driver = RelayHop(host=None, children=hop_children(tree, None, owners=owner_clients, relays=relay_clients),
                      margin_s=MARGIN_S)
    return ServedTree(tree=tree, credentials=credentials, owners=owners, owner_clients=owner_clients,
                      relay_servers=relay_servers, relay_clients=relay_clients, driver=driver, servers=servers,
                      hops=[*hops, driver])


def tree_fixtures(job_id: str, nodes: Sequence[str] = NODES) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A test module's ``served`` (one tree over ``nodes``, fan-out 2, for the module) and ``tree``
    (that tree reset before and after each test) fixtures: ``served, tree = tree_fixtures(...)``."""

    @pytest.fixture(scope="module")
    def served() -> Iterator[ServedTree]:
        tree = serve_tree(Credentials(job_id=job_id, token=secrets.token_urlsafe(32)), list(nodes), fan_out=2)
        yield tree
        tree.close()

    @pytest.fixture
    def tree(served: ServedTree) -> Iterator[ServedTree]:
        served.reset()
        yield served
        served.reset()

    return served, tree
