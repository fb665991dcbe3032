"""A report forwarded through the relay tree over gRPC (issue 44, ``Relay.RelayCall``): one
serialized request for every rank, each rank's reply kept unparsed and returned in rank order
(what asking each owner gives), a failing or unreachable child's ranks carrying its failure
while the others' replies are kept, and only report methods forwarded, and Abort (the survivors'
after a loss: one call per subtree reaches each of its ranks once)."""

from __future__ import annotations

import secrets

import pytest
from relay_stand_ins import NODES, WORLD, ServedTree, serve_tree, tree_fixtures

from zero_ray.control.auth import Credentials
from zero_ray.control.client import RelayClient
from zero_ray.control.client_channel import header_of
from zero_ray.control.handlers import RelayCallArgs
from zero_ray.control.relay_calls import abort_args, forwarded_args, forwarded_results
from zero_ray.errors import ConfigError, ModelError, RemoteFailure


served, tree = tree_fixtures("job-relay-call")


def _stats_args(tree: ServedTree, timeout_s: float = 5.0) -> RelayCallArgs:
    return forwarded_args("Stats", header_of(tree.owner_clients[0].config), ranks=range(WORLD), timeout_s=timeout_s)


def test_every_ranks_report_comes_back_in_rank_order(tree: ServedTree) -> None:
    reply = tree.driver.relay_call(_stats_args(tree))
    assert reply.failure is None and reply.ranks.covers(WORLD)
    assert [o.rank for o in reply.replies] == list(range(WORLD))
    assert all(owner.calls == ["stats"] for owner in tree.owners)  # each asked once
    direct = [tree.owner_clients[r].stats() for r in range(WORLD)]
    assert forwarded_results("Stats", reply) == direct
    assert [s.memory_bytes["params"] for s in direct] == [100 * (r + 1) for r in range(WORLD)]


def test_a_failing_owner_is_its_ranks_failure_and_the_others_are_kept(tree: ServedTree) -> None:
    tree.owners[3].fail_with = ModelError("counters unavailable")
    reply = tree.driver.relay_call(_stats_args(tree))
    failure = reply.failure
    assert failure is not None and (failure.rank, failure.node) == (3, "node-b")
    assert (failure.detail.type, failure.detail.operation) == ("ModelError", "PartitionOwner.Stats")
    assert [o.rank for o in reply.replies if o.failure is not None] == [3]
    assert [s.rank for s in forwarded_results("Stats", reply)] == [0, 1, 2, 4, 5, 6, 7]


def test_an_unreachable_relay_fails_its_ranks_named_by_its_host() -> None:
    served = serve_tree(Credentials(job_id="job-relay-call", token=secrets.token_urlsafe(32)), NODES, fan_out=2)
    try:
        node_d = served.tree.node_relay("node-d")
        served.relay_servers[node_d.id].stop(0.0)
        reply = served.driver.relay_call(_stats_args(served))
        failed = [(o.rank, o.failure.rank, o.failure.detail.operation) for o in reply.replies if o.failure is not None]
        assert failed == [(6, 6, "Relay.RelayCall"), (7, 6, "Relay.RelayCall")]
        assert [s.rank for s in forwarded_results("Stats", reply)] == list(range(6))
    finally:
        served.close()


def test_a_served_relay_forwards_over_grpc_and_refuses_other_methods(tree: ServedTree) -> None:
    node_a = tree.tree.node_relay("node-a")
    header = header_of(tree.owner_clients[0].config)
    with RelayClient(tree.client_config(tree.relay_servers[node_a.id])) as client:
        args = forwarded_args("Flight", header, ranks=node_a.ranks, timeout_s=5.0)
        reply = client.relay_call(RelayCallArgs.of("Flight", args.request, ranks=node_a.ranks, timeout_s=5.0,
                                                   relay=node_a.id))
        assert [o.rank for o in reply.replies] == [0, 1] and reply.failure is None
        assert forwarded_results("Flight", reply) == [tree.owner_clients[r].flight() for r in (0, 1)]
        with pytest.raises(RemoteFailure, match="RelayError"):  # another subtree's ranks
            client.relay_call(RelayCallArgs.of("Stats", args.request, ranks=[5], timeout_s=5.0, relay=node_a.id))
    with pytest.raises(ConfigError, match="forwards only"):
        RelayCallArgs.of("Reshard", b"", ranks=[0], timeout_s=5.0)


def test_an_abort_reaches_every_rank_of_a_subtree_once_through_its_relay(tree: ServedTree) -> None:
    # RelayPlane.abort calls a subtree's relay on its host (here one above two node relays);
    # the ranks outside it are not its to abort.
    upper = tree.tree.driver_children[0]
    ranks = tree.tree.ranks_under(upper.id)
    assert 1 < len(ranks) < WORLD
    header = header_of(tree.owner_clients[0].config)
    with RelayClient(tree.client_config(tree.relay_servers[upper.id])) as client:
        reply = client.relay_call(abort_args(header, reason="rank 7 lost", generation=3, ranks=ranks, timeout_s=5.0,
                                             relay=upper.id))
    assert [o.rank for o in reply.replies] == list(ranks) and reply.failure is None
    assert [tree.owners[r].aborts for r in ranks] == [[("rank 7 lost", 3)]] * len(ranks)
    assert [o.aborts for o in tree.owners if o.rank not in ranks] == [[]] * (WORLD - len(ranks))
