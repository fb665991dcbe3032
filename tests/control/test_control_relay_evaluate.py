"""An evaluation through the relay tree over gRPC (issue 44): driver -> upper relays -> node
relays -> stand-in owners. Every owner evaluates its own indices once; the reply is every
owner's loss totals combined exactly (what the direct path gives), a failing or unreachable
child the reply's failure with its rank and node while the others' totals are kept; and a
step still goes through the same hops after an evaluation."""

from __future__ import annotations

import secrets
from fractions import Fraction

import pytest
from relay_stand_ins import (
    NODES,
    WORLD,
    ServedTree,
    evaluate_args,
    relay_args,
    relay_evaluate_args,
    serve_tree,
    tree_fixtures,
)

from zero_ray.control.auth import Credentials
from zero_ray.control.client import RelayClient
from zero_ray.control.handlers import EvaluateArgs, Piece, RelayEvaluateArgs, combine
from zero_ray.core.reply_combine import CombinedEvaluation, combine_evaluations
from zero_ray.errors import ConfigError, ModelError, RemoteFailure


served, tree = tree_fixtures("job-relay-eval")


def _direct(tree: ServedTree, batch: int, skip: tuple[int, ...] = ()) -> list:
    return [tree.owner_clients[r].evaluate(evaluate_args(r, WORLD, batch=batch))
            for r in range(WORLD) if r not in skip]


@pytest.mark.parametrize("dyadic", [True, False])
def test_an_evaluation_through_the_tree_is_every_owners_totals_combined(dyadic: bool) -> None:
    served = serve_tree(Credentials(job_id="job-relay-eval", token=secrets.token_urlsafe(32)), NODES, fan_out=2,
                        dyadic=dyadic)
    try:
        reply = served.driver.relay_evaluate(relay_evaluate_args(WORLD, batch=2))
        for owner in served.owners:  # each owner got its own piece (counts differ by rank), once
            assert owner.evaluations == [evaluate_args(owner.rank, WORLD, batch=2)]
        direct = _direct(served, 2)
        assert reply == combine_evaluations(CombinedEvaluation.of(r) for r in direct)
        assert reply.ranks.covers(WORLD) and reply.failure is None
        assert reply.totals.samples == sum(4 + r for r in range(WORLD))
        if dyadic:  # every sum exact in floats: the figures are the direct path's float sums
            assert reply.totals.figures() == combine([r.totals for r in direct])
        else:  # the 0.1 losses: summed exactly and rounded once, not once per hop
            assert reply.totals.loss_sum.value == float(sum(Fraction(r.totals.loss_sum) for r in direct))
    finally:
        served.close()


def test_a_failing_owner_is_the_first_failure_and_the_others_are_kept(tree: ServedTree) -> None:
    tree.owners[6].fail_with = ModelError("the batch has no labels")
    reply = tree.driver.relay_evaluate(relay_evaluate_args(WORLD))
    failure = reply.failure
    assert failure is not None and (failure.rank, failure.node) == (6, "node-d")
    assert (failure.detail.type, failure.detail.rank, failure.detail.operation) == \
        ("ModelError", 6, "PartitionOwner.Evaluate")
    assert "no labels" in failure.detail.message
    tree.owners[6].fail_with = None
    kept = combine_evaluations(CombinedEvaluation.of(r) for r in _direct(tree, 0, skip=(6,)))
    assert reply == kept + CombinedEvaluation.failed(failure)
    assert reply.ranks.covers(WORLD)


def test_an_unreachable_relay_is_a_failure_for_its_ranks_named_by_its_host() -> None:
    served = serve_tree(Credentials(job_id="job-relay-eval", token=secrets.token_urlsafe(32)), NODES, fan_out=2)
    try:
        node_b = served.tree.node_relay("node-b")
        served.relay_servers[node_b.id].stop(0.0)
        reply = served.driver.relay_evaluate(relay_evaluate_args(WORLD))
        assert reply.failure is not None and (reply.failure.rank, reply.failure.node) == (2, "node-b")
        assert (reply.failure.detail.type, reply.failure.detail.operation) == ("OwnerLostError", "Relay.RelayEvaluate")
        assert reply.ranks.covers(WORLD)
        assert reply.totals.samples == sum(4 + r for r in range(WORLD) if r not in (2, 3))
        assert served.owners[2].evaluations == [] and len(served.owners[0].evaluations) == 1
    finally:
        served.close()


def test_a_served_relay_evaluates_over_grpc_and_a_staged_batch_reaches_every_rank_alike(tree: ServedTree) -> None:
    node_c = tree.tree.node_relay("node-c")
    staged = EvaluateArgs(piece=Piece(batch_key="7:eval1"), generation=1)
    with RelayClient(tree.client_config(tree.relay_servers[node_c.id])) as client:
        reply = client.relay_evaluate(RelayEvaluateArgs.of(staged, ranks=node_c.ranks, timeout_s=5.0,
                                                           relay=node_c.id))
        with pytest.raises(RemoteFailure, match="RelayError"):  # another subtree's ranks are refused
            client.relay_evaluate(RelayEvaluateArgs.of(staged, ranks=[0], timeout_s=5.0, relay=node_c.id))
    assert [o.evaluations for o in tree.owners[4:6]] == [[staged], [staged]]
    assert reply.ranks.spans == ((4, 6),) and reply.failure is None
    # The stand-in reads no staged batch: no indices, no samples; the wire kept the (empty) totals.
    assert reply.totals.samples == 0 and reply.totals.counted is None
    # A step on the same hops after the evaluation: the hop's channels serve both methods.
    step = tree.driver.relay_step(relay_args(1, WORLD))
    assert step.failure is None and step.ranks.covers(WORLD)


def test_packed_evaluations_are_checked_and_cut_per_rank() -> None:
    args = relay_evaluate_args(WORLD)
    assert [args.rank_args(r) for r in range(WORLD)] == [evaluate_args(r, WORLD) for r in range(WORLD)]
    child = args.for_ranks([2, 3], timeout_s=1.5, relay=4)
    assert isinstance(child, RelayEvaluateArgs) and (child.timeout_s, child.relay) == (1.5, 4)
    assert [child.rank_args(r) for r in (2, 3)] == [evaluate_args(r, WORLD) for r in (2, 3)]
    with pytest.raises(ConfigError, match="RelayEvaluateArgs.*indices"):
        RelayEvaluateArgs.of(evaluate_args(0, WORLD), ranks=[0], timeout_s=1.0)
    with pytest.raises(ConfigError, match="rank 5 is not among"):
        child.rank_args(5)
