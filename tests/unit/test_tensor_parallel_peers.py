"""Peer redundancy under tensor parallelism, planned purely (core/reshard_plan.backup_peers,
core/tensor_parallel_ranks.shard_moves): every rank's copy is kept by an owner of the same TP
shard (another node when there is one), and a restore from those copies moves each shard only
between its own holders and takers, whether one TP rank or a whole TP group was lost.
Milliseconds."""

from __future__ import annotations

import pytest

from zero_ray.core.reshard_plan import backup_peers, plan_moves
from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks, shard_moves
from zero_ray.errors import ConfigError


def nodes_of_groups(size: int, data_parallel: int, groups_per_node: int) -> list[str]:
    """Each TP group on one node (core/placement.place_groups), ``groups_per_node`` to a node."""
    return [f"n{(r // size) // groups_per_node}" for r in range(size * data_parallel)]


@pytest.mark.parametrize(("size", "data_parallel", "per_node"), [(2, 2, 1), (2, 2, 2), (2, 3, 1), (4, 2, 1),
                                                                 (2, 4, 2), (3, 3, 3)])
def test_backups_stay_within_a_shard_and_leave_the_node_when_they_can(size: int, data_parallel: int,
                                                                       per_node: int) -> None:
    nodes = nodes_of_groups(size, data_parallel, per_node)
    ranks = TensorParallelRanks(world_size=len(nodes), size=size)
    backup = backup_peers(nodes, tensor_parallel=size)
    assert sorted(backup) == list(range(len(nodes)))  # a bijection: each rank keeps one peer's copy
    for r, b in enumerate(backup):
        assert b != r and ranks.tp_rank(b) == ranks.tp_rank(r), (r, b)  # the same shard's layout
        if len(set(nodes)) > 1:
            assert nodes[b] != nodes[r], (r, b)  # a node's loss leaves the copy
    # T = 1 unchanged: the plain ring over every rank
    assert backup_peers(nodes) == backup_peers(nodes, tensor_parallel=1)


def test_backups_at_two_by_two_pair_the_data_parallel_owners() -> None:
    assert backup_peers(["a", "a", "b", "b"], tensor_parallel=2) == [2, 3, 0, 1]
    # D = 1: no other owner holds the shard, every rank its own backup (the checkpoint restores)
    assert backup_peers(["a", "a"], tensor_parallel=2) == [0, 1]
    with pytest.raises(ConfigError, match="not whole tensor_parallel groups of 2"):
        backup_peers(["a", "a", "a"], tensor_parallel=2)


def test_shard_moves_of_a_live_resize_keep_each_shard_on_its_owners() -> None:
    got = shard_moves(size=2, old_world=4, new_world=6)
    assert [(s.shard, s.old_ranks, s.senders, s.receivers) for s in got] == [
        (0, (0, 2), (0, 2), (0, 2, 4)), (1, (1, 3), (1, 3), (1, 3, 5))]
    (one,) = shard_moves(size=1, old_world=3, new_world=2, holders=[2, 0, 1])
    assert (one.old_ranks, one.senders, one.receivers) == ((0, 1, 2), (2, 0, 1), (0, 1))
    with pytest.raises(ConfigError, match="world_size=5 is not divisible by tensor_parallel size=2"):
        shard_moves(size=2, old_world=4, new_world=5)
    with pytest.raises(ConfigError, match="names 3 holders"):
        shard_moves(size=2, old_world=4, new_world=4, holders=[0, 1, 2])


def restore(size: int, data_parallel: int, lost: set[int], target: int) -> dict[int, set[int]]:
    """What the driver plans after ``lost`` (driver/recovery._restore_from_peers), checked move by
    move: returns, per new position, the old world ranks it receives state of."""
    world = size * data_parallel
    backup = backup_peers(["n"] * world, tensor_parallel=size)
    copies = {r: {r} | {w for w, b in enumerate(backup) if b == r} for r in range(world)}  # own + ward
    kept = [r for r in range(world) if r not in lost][:target]  # the highest survivors leave
    holder: dict[int, int] = {}
    for position, old in enumerate(kept):
        for rank in sorted(copies[old]):
            holder.setdefault(rank, position)
    assert sorted(holder) == list(range(world)), "a copy of every old rank survives"
    received: dict[int, set[int]] = {}
    for shard in shard_moves(size=size, old_world=world, new_world=target,
                             holders=[holder[r] for r in range(world)]):
        for m in plan_moves([96, 30], old_world=len(shard.old_ranks), new_world=len(shard.receivers),
                            whole=False):
            old, sender, taker = shard.old_ranks[m.src], shard.senders[m.src], shard.receivers[m.dst]
            assert old % size == shard.shard == taker % size  # a shard's state to a taker of that shard
            assert old in copies[kept[sender]]  # sent by an actor that holds a copy of it
            received.setdefault(taker, set()).add(old)
    return received


@pytest.mark.parametrize(("lost", "target"), [({3}, 2), ({3}, 4), ({1}, 4), ({2, 3}, 2), ({0, 1}, 2)])
def test_a_lost_tp_rank_or_whole_group_comes_back_from_its_shards_peers(lost: set[int], target: int) -> None:
    received = restore(2, 2, lost, target)
    for shard in range(2):  # each shard's takers receive all of it, from its old owners' copies only
        takers = range(shard, target, 2)
        assert set().union(*(received[p] for p in takers)) == {shard, shard + 2}
    if target == 4:  # D kept: each position takes its own old rank's range
        assert received == {p: {p} for p in range(4)}
    else:  # D = 1: each TP rank's one owner takes both data-parallel ranks' ranges of its shard
        assert received == {0: {0, 2}, 1: {1, 3}}


def test_losing_every_copy_of_a_shard_is_found_in_the_plan() -> None:
    with pytest.raises(AssertionError, match="a copy of every old rank survives"):
        restore(2, 2, {1, 3}, 2)  # shard 1's two owners hold each other's copy: the checkpoint restores


class _PeerPool:
    """The pool a RecoveryController drives, as far as a peer restore asks: each rank's peer
    snapshots (its own and those it backs up, from ``backup``), and the kills and rebuild it orders,
    recorded in ``calls``."""

    def __init__(self, size: int, nodes: list[str], backup: list[int], calls: list[tuple[str, object]]) -> None:
        self.tensor_parallel = size
        self.nodes = [{"node_id": n} for n in nodes]
        self.world = len(nodes)
        self.copies = {r: {r} | {w for w, b in enumerate(backup) if b == r} for r in range(self.world)}
        self.calls = calls

    def snapshot_info(self, ranks: list[int], committed: int) -> dict[int, dict[int, object]]:
        from zero_ray.core.restore_plan import SnapshotRecord

        return {r: {c: SnapshotRecord(step=3, world_size=self.world, description=None)  # type: ignore[arg-type]
                    for c in self.copies[r]} for r in ranks}

    def kill(self, ranks: list[int]) -> None:
        self.calls.append(("kill", list(ranks)))

    def rebuild(self, kept: list[int], world_size: int, *, restore: object) -> None:
        self.calls.append(("rebuild", (list(kept), world_size, restore(None))))  # type: ignore[operator]


def _recovery_over(pool: _PeerPool, world: int) -> object:
    from zero_ray.core.elastic_policy import FailurePolicy, ScalingPolicy
    from zero_ray.core.topology import Topology
    from zero_ray.driver.recovery import RecoveryController

    return RecoveryController(pool, failure=FailurePolicy(), scaling=ScalingPolicy(), desired=world,  # type: ignore[arg-type]
                              peer_redundancy=True, checkpoint_root=lambda: None, topology=Topology())


def test_the_recovery_rebuilds_tp_groups_on_one_node_each() -> None:
    """The driver's re-plan after a loss at (T, D) = (2, 3), one TP group per node: owner 1 (node
    a) lost, the 4 owners that go on are the two intact groups in their old TP positions
    (core/placement.group_survivors), not owners 0 and 2 of nodes a and b as one group; and the
    peer restore takes every old rank's copy from the survivors kept."""
    size, world = 2, 6
    nodes = ["a", "a", "b", "b", "c", "c"]
    backup = backup_peers(nodes, tensor_parallel=size)
    calls: list[tuple[str, object]] = []
    pool = _PeerPool(size, nodes, backup, calls)
    rc = _recovery_over(pool, world)
    survivors = [0, 2, 3, 4, 5]
    assert backup[1] == 3  # the lost owner's copy is on another node's owner, which is kept
    assert rc._restore_from_peers(survivors, 4, 3) == 4
    (kill, rebuilt) = calls
    assert kill == ("kill", [0])
    kept, target, plan = rebuilt[1]  # type: ignore[misc]
    assert (kept, target) == ([2, 3, 4, 5], 4)
    assert [nodes[kept[p]] for p in range(0, 4, 2)] == [nodes[kept[p + 1]] for p in range(0, 4, 2)]
    for old, position in enumerate(plan.holders):
        assert old in pool.copies[kept[position]]  # each old rank's copy from a survivor kept


def test_a_recovery_that_shrinks_keeps_the_holder_of_the_lost_copies() -> None:
    """(T, D) = (2, 4), a TP group per node; owner 0 lost and the run goes on at 4 owners (two
    groups). Kept by rank, groups (2, 3) and (4, 5) would hold no copy of old ranks 6 and 7 (their
    backups were 0, lost, and 1), and the peer restore would give up for the checkpoint; the
    recovery keeps groups (2, 3) and (6, 7) instead, and takes every old rank's copy from them."""
    size, world = 2, 8
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    backup = backup_peers(nodes, tensor_parallel=size)
    assert backup == [2, 3, 4, 5, 6, 7, 0, 1]
    calls: list[tuple[str, object]] = []
    pool = _PeerPool(size, nodes, backup, calls)
    rc = _recovery_over(pool, world)
    assert rc._restore_from_peers([1, 2, 3, 4, 5, 6, 7], 4, 3) == 4  # peer source: no CheckpointError
    (kill, rebuilt) = calls
    assert kill == ("kill", [1, 4, 5])
    kept, target, plan = rebuilt[1]  # type: ignore[misc]
    assert (kept, target) == ([2, 3, 6, 7], 4)
    assert {6, 7} <= set(kept)  # their own copies were their only ones left (backups 0 and 1 lost or leaving)
    for old, position in enumerate(plan.holders):
        assert old in pool.copies[kept[position]]  # each old rank's copy from a survivor kept
