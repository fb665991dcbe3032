"""RelayHost: the relays one process serves, as the ``Relay`` service's handler (relay.proto).

A relay runs in the process of the lowest rank under it (``core/relay_tree.py``), so one owner
may serve several relays (its node's and, above the node level, one per level it is lowest
in). The driver tells each such process which relays it serves, and their children, with
``HostRelays`` after every membership change (``driver/relay_plane.py``); the host builds a
:class:`RelayHop` for each, with clients that carry the run's credentials and TLS settings
(the ``template`` client configuration, its address replaced by each child's), and closes the
hops and clients it served before. ``RelayStep`` runs on the hop its request names.

The host holds no model state and knows no owner: it is the same object in an owner's process
(``owner/service/actor.py``), on a stand-in in the tests, or anywhere a light relay would run.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

from zero_ray.control.client import OwnerClient, RelayClient
from zero_ray.control.client_channel import ClientConfig
from zero_ray.control.handlers import (
    FailureContext,
    HostedRelay,
    HostRelaysArgs,
    HostRelaysResult,
    RelayCallArgs,
    RelayChildSeat,
    RelayEvaluateArgs,
    RelayStepArgs,
)
from zero_ray.control.relay_hop import HopChild, OwnerChild, RelayChild, RelayHop, close_relays
from zero_ray.core.relay_tree import RelayTree
from zero_ray.core.reply_combine import CombinedEvaluation, CombinedReplies, CombinedStep
from zero_ray.errors import RelayError

__all__ = ["RelayHost", "host_plans"]


class RelayHost:
    """The relays a process serves (none until :meth:`host_relays`), by relay id. ``rank``:
    the rank whose process this is (named in a failed relay call); ``template``: the client
    configuration its hops' clients copy, address aside."""

    _rank: int | None
    _template: ClientConfig
    _lock: threading.Lock
    _hops: dict[int, RelayHop]
    _clients: list[OwnerClient | RelayClient]

    def __init__(self, *, rank: int | None, template: ClientConfig) -> None:
        self._rank = rank
        self._template = template
        self._lock = threading.Lock()
        self._hops = {}
        self._clients = []

    @classmethod
    def serving(cls, hops: Mapping[int, RelayHop], *, rank: int | None, template: ClientConfig) -> RelayHost:
        """A host serving ``hops`` (by relay id) as built by the caller; :meth:`close` closes them."""
        host = cls(rank=rank, template=template)
        host._hops = dict(hops)
        return host

    @property
    def relays(self) -> tuple[int, ...]:
        """The ids of the relays served now, ascending."""
        with self._lock:
            return tuple(sorted(self._hops))

    def host_relays(self, args: HostRelaysArgs) -> HostRelaysResult:
        """Serve ``args.relays`` from now on; the hops served before are closed (a step still
        on one comes back failed, and the driver's recovery re-plans anyway)."""
        clients: list[OwnerClient | RelayClient] = []
        hops: dict[int, RelayHop] = {}
        try:
            for hosted in args.relays:
                children = tuple(self._child(seat, clients) for seat in hosted.children)
                hops[hosted.relay] = RelayHop(host=self._rank, children=children, margin_s=args.margin_s)
        except BaseException:
            close_relays(hops.values(), clients)
            raise
        with self._lock:
            old_hops, old_clients = self._hops, self._clients
            self._hops, self._clients = hops, clients
        close_relays(old_hops.values(), old_clients)
        return HostRelaysResult(relays=tuple(sorted(hops)))

    def _child(self, seat: RelayChildSeat, clients: list[OwnerClient | RelayClient]) -> HopChild:
        config = dataclasses.replace(self._template, address=seat.address)
        if seat.relay is None:
            if len(seat.ranks) != 1 or seat.ranks[0] != seat.host:
                raise RelayError(f"an owner child names ranks {list(seat.ranks)} and host {seat.host}: an owner is "
                                 "its one rank; the driver's plan is not this protocol's")
            owner = OwnerClient(config)
            clients.append(owner)
            return OwnerChild(rank=seat.host, node=seat.node, client=owner)
        relay = RelayClient(config)
        clients.append(relay)
        return RelayChild(relay=seat.relay, ranks=tuple(seat.ranks), host=seat.host, node=seat.node, client=relay)

    def hop(self, relay: int) -> RelayHop:
        """The hop of relay ``relay``; RelayError when this process does not serve it."""
        with self._lock:
            hop = self._hops.get(relay)
            served = sorted(self._hops)
        if hop is None:
            raise RelayError(f"a call was sent to relay {relay}, but this process (rank {self._rank}) serves "
                             f"relays {served}: the caller's tree is not the one last hosted; re-plan the relays")
        return hop

    def relay_step(self, args: RelayStepArgs) -> CombinedStep:
        """Run ``args`` on the relay it names."""
        return self.hop(args.relay).relay_step(args)

    def relay_evaluate(self, args: RelayEvaluateArgs) -> CombinedEvaluation:
        """Run ``args`` on the relay it names."""
        return self.hop(args.relay).relay_evaluate(args)

    def relay_call(self, args: RelayCallArgs) -> CombinedReplies:
        """Run ``args`` on the relay it names."""
        return self.hop(args.relay).relay_call(args)

    def failure_context(self) -> FailureContext:
        """What a failed relay call's FailureDetail says: the rank whose process serves it."""
        return FailureContext(rank=self._rank, phase="relaying")

    def close(self) -> None:
        """Close every hop and client served. Idempotent."""
        with self._lock:
            hops, clients = self._hops, self._clients
            self._hops, self._clients = {}, []
        close_relays(hops.values(), clients)


def host_plans(tree: RelayTree, addresses: Mapping[int, str], *, margin_s: float) -> dict[int, HostRelaysArgs]:
    """What each process of ``tree`` is to serve, by the rank whose process it is: every relay
    it hosts, with its children's control addresses (``addresses`` by rank). A rank hosting no
    relay is absent: it serves none."""
    hosted: dict[int, list[HostedRelay]] = {}
    for relay in tree.relays:
        if relay.ranks:
            seats = tuple(RelayChildSeat(ranks=(r,), host=r, node=tree.nodes[r], address=addresses[r])
                          for r in relay.ranks)
        else:
            seats = tuple(RelayChildSeat(ranks=tree.ranks_under(c.id), host=c.host, node=tree.nodes[c.host],
                                         address=addresses[c.host], relay=c.id) for c in tree.children(relay.id))
        hosted.setdefault(relay.host, []).append(HostedRelay(relay=relay.id, children=seats))
    return {rank: HostRelaysArgs(relays=tuple(relays), margin_s=margin_s) for rank, relays in sorted(hosted.items())}
