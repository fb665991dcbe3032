"""Relays hosted in the owners' own processes, as the pool runs them (issue 44): every owner's
server serves a RelayHost beside its owner service; ``host_plans`` says what each process
serves, sent over the wire with HostRelays; a step through the driver's hop over the hosted
top relays comes back as every owner's reply combined, and hosting again replaces the relays."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from control_fakes import WAIT_S, server_config
from relay_stand_ins import StandInOwner, relay_args, step_args

from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient, RelayClient
from zero_ray.control.handlers import HostedRelay, HostRelaysArgs, RelayChildSeat
from zero_ray.control.relay_hop import RelayHop, hop_children
from zero_ray.control.relay_host import RelayHost, host_plans
from zero_ray.control.server import ControlServer
from zero_ray.core.relay_tree import RelayConfig, plan_relays
from zero_ray.core.reply_combine import CombinedStep, combine_steps
from zero_ray.errors import RemoteFailure

NODES = [f"node-{n}" for n in "abc" for _ in range(3)]  # three ranks a node
WORLD = len(NODES)


@dataclass(kw_only=True)
class Processes:
    """One server per rank serving its owner and its RelayHost, and a client of each."""

    credentials: Credentials
    owners: list[StandInOwner]
    hosts: list[RelayHost]
    servers: list[ControlServer]
    owner_clients: dict[int, OwnerClient]
    relay_clients: dict[int, RelayClient]  # by rank: the Relay service of rank r's process

    @property
    def addresses(self) -> dict[int, str]:
        return {r: s.address for r, s in enumerate(self.servers)}

    def close(self) -> None:
        for client in [*self.owner_clients.values(), *self.relay_clients.values()]:
            client.close()
        for host in self.hosts:
            host.close()
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def processes() -> Iterator[Processes]:
    credentials = Credentials(job_id="job-host", token=secrets.token_urlsafe(32))
    owners = [StandInOwner(r) for r in range(WORLD)]
    hosts, servers, owner_clients, relay_clients = [], [], {}, {}
    for owner in owners:
        server = ControlServer(server_config(credentials, threads=8, max_streams=2))
        template = ClientConfig(address="127.0.0.1:1", credentials=credentials, timeout_s=WAIT_S)
        host = RelayHost(rank=owner.rank, template=template)
        server.add_owner(owner)
        server.add_relay(host)
        server.start()
        config = ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S)
        hosts.append(host)
        servers.append(server)
        owner_clients[owner.rank] = OwnerClient(config)
        relay_clients[owner.rank] = RelayClient(config)
    out = Processes(credentials=credentials, owners=owners, hosts=hosts, servers=servers,
                    owner_clients=owner_clients, relay_clients=relay_clients)
    yield out
    out.close()


def _host(processes: Processes, fan_out: int) -> RelayHop:
    """Host ``plan_relays(NODES, fan_out)`` over the wire; the driver's hop over its top relays."""
    tree = plan_relays(NODES, RelayConfig(fan_out=fan_out))
    plans = host_plans(tree, processes.addresses, margin_s=0.2)
    for rank in range(WORLD):  # every process, so that one no longer hosting serves none
        result = processes.relay_clients[rank].host_relays(plans.get(rank, HostRelaysArgs()))
        assert result.relays == tuple(sorted(r.relay for r in plans.get(rank, HostRelaysArgs()).relays))
    tops = {c.id: processes.relay_clients[c.host] for c in tree.driver_children}
    return RelayHop(host=None, children=hop_children(tree, None, owners=processes.owner_clients, relays=tops),
                    margin_s=0.2)


@pytest.mark.parametrize("fan_out", [2, 3, 8])
def test_a_step_through_hosted_relays_is_every_owner_s_reply_combined(processes: Processes, fan_out: int) -> None:
    for owner in processes.owners:
        owner.steps.clear()
    driver = _host(processes, fan_out)
    try:
        reply = driver.relay_step(relay_args(2, WORLD))
    finally:
        driver.close()
    direct = [processes.owner_clients[r].step(step_args(2, r, WORLD)) for r in range(WORLD)]
    assert reply == combine_steps(CombinedStep.of(r) for r in direct)
    assert reply.ranks.covers(WORLD) and reply.failure is None
    for owner in processes.owners:  # each owner ran its own step once through the tree, once directly
        assert owner.steps == [step_args(2, owner.rank, WORLD)] * 2
    # each relay is served by the process of the lowest rank under it, and by no other
    tree = plan_relays(NODES, RelayConfig(fan_out=fan_out))
    hosted = {r: h.relays for r, h in enumerate(processes.hosts) if h.relays}
    expected: dict[int, list[int]] = {}
    for relay in tree.relays:
        assert relay.host == min(tree.ranks_under(relay.id))
        expected.setdefault(relay.host, []).append(relay.id)
    assert hosted == {r: tuple(sorted(ids)) for r, ids in expected.items()}
    assert {0, 3, 6} <= set(hosted)  # every node's lowest rank hosts its node relay


def test_a_step_for_a_relay_the_process_does_not_serve_is_refused(processes: Processes) -> None:
    _host(processes, 8).close()
    served = processes.hosts[3].relays
    with pytest.raises(RemoteFailure, match="serves relays") as caught:
        processes.relay_clients[3].relay_step(relay_args(0, WORLD, ranks=[3, 4, 5], relay=max(served) + 100))
    assert caught.value.detail.type == "RelayError" and caught.value.detail.rank == 3


def test_hosting_none_serves_none_and_a_bad_seat_is_refused(processes: Processes) -> None:
    assert processes.relay_clients[4].host_relays(HostRelaysArgs()).relays == ()
    assert processes.hosts[4].relays == ()
    bad = HostRelaysArgs(relays=(HostedRelay(relay=1, children=(
        RelayChildSeat(ranks=(4, 5), host=4, node="node-b", address=processes.addresses[4]),)),))
    with pytest.raises(RemoteFailure, match="an owner child names ranks") as caught:
        processes.relay_clients[4].host_relays(bad)
    assert caught.value.detail.type == "RelayError"
    assert processes.hosts[4].relays == ()  # nothing half-hosted
