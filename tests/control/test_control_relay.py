"""One relay hop over gRPC (issue 44): a step through a two-level tree of served relays
(driver -> upper relays -> node relays -> owners, planned by plan_relays) comes back as every
owner's reply combined, a failing, unreachable or late child as the reply's failure with its
rank and node while the others' figures are kept, and every hop checks the run's token."""

from __future__ import annotations

import dataclasses
import secrets
import time

import pytest
from control_fakes import WAIT_S
from relay_stand_ins import MARGIN_S, NODES, WORLD, ServedTree, relay_args, serve_tree, step_args, tree_fixtures

from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient, RelayClient
from zero_ray.control.relay_hop import OwnerChild, RelayHop, hop_children
from zero_ray.core.reply_combine import CombinedStep, combine_steps
from zero_ray.driver.reports import StepMetrics
from zero_ray.errors import AuthError, ConfigError, ModelError, RemoteFailure


served, tree = tree_fixtures("job-relay")


def _direct(tree: ServedTree, step: int, skip: tuple[int, ...] = ()) -> list:
    """Every owner's reply to ``step``, asked directly (the stand-ins answer a step alike each time)."""
    return [tree.owner_clients[r].step(step_args(step, r, WORLD)) for r in range(WORLD) if r not in skip]


def test_the_tree_has_two_levels_of_relays(tree: ServedTree) -> None:
    assert tree.tree.depth == 2 and len(tree.tree.top) == 2
    assert [len(tree.tree.node_relay(n).ranks) for n in sorted(set(NODES))] == [2, 2, 2, 2]


@pytest.mark.parametrize("dyadic", [True, False])
def test_a_step_through_the_tree_is_every_owners_reply_combined(dyadic: bool) -> None:
    # The 0.1 losses round differently in another order: the reply is still exactly the
    # combination of all eight, not one rounding of its own per hop.
    served = serve_tree(Credentials(job_id="job-relay", token=secrets.token_urlsafe(32)), NODES, fan_out=2,
                        dyadic=dyadic)
    try:
        reply = served.driver.relay_step(relay_args(3, WORLD))
        for owner in served.owners:  # each owner got its own step, once
            assert owner.steps == [step_args(3, owner.rank, WORLD)]
        direct = _direct(served, 3)
        assert reply == combine_steps(CombinedStep.of(r) for r in direct)
        assert reply.ranks.covers(WORLD) and reply.failure is None
        assert dict(reply.bytes_sent) == {"all_gather": 7 * sum(range(WORLD)),
                                          "reduce_scatter": 1000 * sum(range(1, WORLD + 1))}
        if dyadic:
            kw = dict(step=4, samples=WORLD * 4, seconds=0.5, sent_ahead=False)
            assert StepMetrics.of(reply, **kw) == StepMetrics.of(combine_steps(CombinedStep.of(r) for r in direct), **kw)
    finally:
        served.close()


def test_a_failing_owner_is_the_first_failure_and_the_others_are_kept(tree: ServedTree) -> None:
    tree.owners[5].fail_with = ModelError("the loss is not a scalar")
    reply = tree.driver.relay_step(relay_args(1, WORLD))
    failure = reply.failure
    assert failure is not None and (failure.rank, failure.node) == (5, "node-c")
    assert (failure.detail.type, failure.detail.rank, failure.detail.operation) == \
        ("ModelError", 5, "PartitionOwner.Step")
    assert "not a scalar" in failure.detail.message
    tree.owners[5].fail_with = None
    kept = combine_steps(CombinedStep.of(r) for r in _direct(tree, 1, skip=(5,)))
    assert reply == kept + CombinedStep.failed(failure)  # every other owner's figures, exactly
    assert reply.ranks.covers(WORLD)


def test_an_unreachable_relay_is_a_failure_for_its_ranks_named_by_its_host() -> None:
    served = serve_tree(Credentials(job_id="job-relay", token=secrets.token_urlsafe(32)), NODES, fan_out=2)
    try:
        node_c = served.tree.node_relay("node-c")
        served.relay_servers[node_c.id].stop(0.0)
        reply = served.driver.relay_step(relay_args(2, WORLD))
        assert reply.failure is not None and (reply.failure.rank, reply.failure.node) == (4, "node-c")
        assert (reply.failure.detail.type, reply.failure.detail.operation) == ("OwnerLostError", "Relay.RelayStep")
        assert reply.ranks.covers(WORLD) and reply.totals.samples == 6 * 4  # ranks 4 and 5 carry none
        assert served.owners[4].steps == [] and len(served.owners[6].steps) == 1
    finally:
        served.close()


def test_a_wrong_token_is_refused_at_every_hop(tree: ServedTree) -> None:
    wrong = Credentials(job_id=tree.credentials.job_id, token=secrets.token_urlsafe(32))
    top = tree.relay_servers[tree.tree.top[0]]
    with RelayClient(tree.client_config(top, wrong)) as client, pytest.raises(AuthError, match="UNAUTHENTICATED"):
        client.relay_step(relay_args(0, WORLD))
    assert all(owner.steps == [] for owner in tree.owners)
    # A hop whose own client of an owner carries another token is refused there: that rank
    # fails, the other is kept.
    node_a = tree.tree.node_relay("node-a")
    with OwnerClient(ClientConfig(address=tree.owner_clients[1].address, credentials=wrong,
                                  timeout_s=WAIT_S)) as stranger:
        hop = RelayHop(host=0, children=(OwnerChild(rank=0, node="node-a", client=tree.owner_clients[0]),
                                         OwnerChild(rank=1, node="node-a", client=stranger)))
        reply = hop.relay_step(relay_args(0, WORLD, ranks=node_a.ranks))
    assert reply.failure is not None and (reply.failure.rank, reply.failure.detail.type) == (1, "AuthError")
    assert reply.agreed is not None and reply.agreed.rank == 0 and reply.totals.samples == 4
    assert tree.owners[1].steps == []


def test_a_child_past_the_deadline_is_a_failure_in_bounded_time(tree: ServedTree) -> None:
    tree.owners[3].block_steps = True
    timeout_s = 1.0
    began = time.monotonic()
    reply = tree.driver.relay_step(relay_args(4, WORLD, timeout_s=timeout_s))
    took = time.monotonic() - began
    assert tree.owners[3].step_entered.is_set()
    # Owners get the time less a margin per relay above them, so the node relay names the late
    # rank itself and its reply reaches the driver in time.
    assert took < timeout_s + 0.5, f"the hop took {took:.2f}s past its {timeout_s}s"
    assert took >= timeout_s - 2 * MARGIN_S - 0.05
    failure = reply.failure
    assert failure is not None and (failure.rank, failure.node, failure.detail.type) == (3, "node-b", "CallTimeout")
    assert reply.ranks.covers(WORLD) and reply.totals.samples == 7 * 4


def test_a_step_for_another_subtree_is_refused_by_the_hop(tree: ServedTree) -> None:
    node_b = tree.tree.node_relay("node-b")
    with RelayClient(tree.client_config(tree.relay_servers[node_b.id])) as client, \
            pytest.raises(RemoteFailure, match="RelayError") as caught:
        client.relay_step(relay_args(0, WORLD, ranks=[0], relay=node_b.id))
    assert caught.value.detail.rank == node_b.host and caught.value.detail.type == "RelayError"
    assert all(owner.steps == [] for owner in tree.owners)


def test_children_come_from_the_tree_and_every_client_must_be_handed_in(tree: ServedTree) -> None:
    upper = tree.tree.driver_children[1]
    children = hop_children(tree.tree, upper.id, owners=tree.owner_clients, relays=tree.relay_clients)
    assert [(c.ranks, c.host, c.node) for c in children] == [((4, 5), 4, "node-c"), ((6, 7), 6, "node-d")]
    with pytest.raises(ConfigError, match=r"no owner client was handed in for \[5\]"):
        hop_children(tree.tree, tree.tree.node_relay("node-c").id, owners={4: tree.owner_clients[4]}, relays={})
    with pytest.raises(ConfigError, match="each rank is under exactly one child"):
        RelayHop(host=0, children=[*children, dataclasses.replace(children[0])])
    with pytest.raises(ConfigError, match="timeout_s"):
        relay_args(0, WORLD, ranks=[0], timeout_s=0.0)
