"""The typed resize and restore plans survive their one trip through plain data (the control
plane's JSON fields) unchanged, and a malformed one is refused by name."""

from __future__ import annotations

import json

import pytest

from zero_ray.control.plain import dumps, loads
from zero_ray.core.replica import ReplicaPlan, ReplicaRound
from zero_ray.core.restore_plan import (
    PeerRestore,
    Peers,
    ReplicaRestore,
    ReshardPlan,
    reshard_from_data,
    restore_from_data,
    restore_to_data,
)
from zero_ray.errors import ConfigError

DESCRIPTION = {"position": {"step": 7, "samples_seen": 84}, "scale": 1.0, "table": {3: {"scalars": {"step": "7"}}}}


def _wire(data):  # type: ignore[no-untyped-def]
    return loads(dumps(data))


def test_peers_ward_is_the_inverse_of_backup() -> None:
    peers = Peers.of([1, 2, 0])
    assert peers.ward == (2, 0, 1)
    assert Peers.from_data(_wire(peers.to_data())) == peers


@pytest.mark.parametrize("peers", [None, Peers.of([1, 0])])
def test_restore_plans_round_trip(peers: Peers | None) -> None:
    peer = PeerRestore(old_world=3, holders=(0, 1, 0), description=DESCRIPTION, peers=peers)
    back = restore_from_data(_wire(restore_to_data(peer)))
    assert isinstance(back, PeerRestore) and back == peer
    replica = ReplicaRestore(plan=ReplicaPlan(source=(2, 3), group_size=2, rounds=(
        ReplicaRound(senders=(0, 1), receivers=(0, 1)), ReplicaRound(senders=(0, 1), receivers=(2, 3)))),
        description=DESCRIPTION, peers=peers)
    back = restore_from_data(_wire(restore_to_data(replica)))
    assert isinstance(back, ReplicaRestore) and back == replica
    assert restore_from_data(restore_to_data(None)) is None


def test_a_reshard_plan_keeps_its_description_and_peers_apart() -> None:
    plan = ReshardPlan(description=DESCRIPTION, peers=Peers.of([1, 0]))
    back = reshard_from_data(_wire(plan.to_data()))
    assert back == plan and "peers" not in back.description
    assert reshard_from_data(_wire(ReshardPlan(description=DESCRIPTION).to_data())).peers is None


def test_malformed_plans_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="kind 'snapshot'"):
        restore_from_data({"kind": "snapshot"})
    with pytest.raises(ConfigError, match="3 old ranks names 2 holders"):
        PeerRestore(old_world=3, holders=(0, 1), description={})
    json.dumps(restore_to_data(PeerRestore(old_world=1, holders=(0,), description={"a": 1})))
