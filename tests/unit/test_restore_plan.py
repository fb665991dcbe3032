"""The typed resize and restore plans survive their one trip through plain data (the control
plane's JSON fields) unchanged, and a malformed one is refused by name."""

from __future__ import annotations

import json

import pytest

from zero_ray.control.json_fields import dumps, loads
from zero_ray.core.run_position import Position
from zero_ray.core.replica_plan import ReplicaPlan, ReplicaRound
from zero_ray.core.restore_plan import (
    PeerRestore,
    Peers,
    ReplicaRestore,
    ReshardPlan,
    RunCounters,
    SnapshotRecord,
    TransferDescription,
    reshard_from_data,
    restore_from_data,
    restore_to_data,
)
from zero_ray.errors import ConfigError

COUNTERS = RunCounters(position=Position(step=7, samples_seen=84), scale=1.0, growth_tracker=2,
                       hyper={"optimizers": [[{"lr": 0.001}]], "schedulers": []})
DESCRIPTION = TransferDescription(layout={"specs": [["w", [4, 2], "float32"]], "groups": [[0]]}, whole_params=(0,),
                                  replicated=False, table={0: {"scalars": {"step": "7"}, "elementwise": []}},
                                  counters=COUNTERS)


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
    assert back == plan
    assert reshard_from_data(_wire(ReshardPlan(description=DESCRIPTION).to_data())).peers is None


def test_malformed_plans_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="kind 'snapshot'"):
        restore_from_data({"kind": "snapshot"})
    with pytest.raises(ConfigError, match="3 old ranks names 2 holders"):
        PeerRestore(old_world=3, holders=(0, 1), description=DESCRIPTION)
    with pytest.raises(ConfigError, match="no owner's part"):
        TransferDescription.merged([])
    json.dumps(restore_to_data(PeerRestore(old_world=1, holders=(0,), description=DESCRIPTION)))


def test_a_merged_description_has_every_ranks_table_entries_keyed_by_parameter_index() -> None:
    other = TransferDescription(layout=DESCRIPTION.layout, whole_params=(0,), replicated=False,
                                table={"5": {"scalars": {"step": "7"}, "elementwise": ["exp_avg"]}}, counters=COUNTERS)
    merged = TransferDescription.merged([DESCRIPTION, TransferDescription.from_data(_wire(other.to_data()))])
    assert sorted(merged.table) == [0, 5] and merged.table[5]["elementwise"] == ["exp_avg"]
    assert merged.counters == COUNTERS and merged.layout == DESCRIPTION.layout
    back = TransferDescription.from_data(_wire(merged.to_data()))
    assert back == merged and back.counters.position == Position(step=7, samples_seen=84)


def test_a_snapshot_record_crosses_as_data_and_comes_back_typed() -> None:
    record = SnapshotRecord(step=6, world_size=3, description=DESCRIPTION)
    assert SnapshotRecord.from_data(_wire(record.to_data())) == record
