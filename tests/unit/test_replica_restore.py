"""Restoring from a surviving shard group's replica: the pure planning (core/replica_plan.py) and
the policies' choice of source and size (core/elastic_policy.py)."""

import pytest

from zero_ray.core.elastic_policy import FailurePolicy, ScalingPolicy, Source
from zero_ray.core.replica_plan import keep_whole_groups, replica_plan, surviving_group
from zero_ray.core.topology import Topology, plan_mesh
from zero_ray.errors import ConfigError


def mesh(nodes, g=2):
    return plan_mesh(Topology(shard_group_size=g), nodes)


def test_sources_prefer_a_replica():
    p = FailurePolicy()
    assert p.sources(replica=True, peer=False, checkpoint=True) == [Source.REPLICA, Source.CHECKPOINT]
    assert p.sources(replica=False, peer=False, checkpoint=True) == [Source.CHECKPOINT]
    assert p.sources(replica=True, peer=True, checkpoint=True) == [Source.REPLICA, Source.PEER, Source.CHECKPOINT]
    d = p.after_step_failure(lost_ranks={2, 3}, failures_so_far=1,
                             sources=p.sources(replica=True, peer=False, checkpoint=False))
    assert d.source is Source.REPLICA and d.action.value == "restore"


def test_restore_size_keeps_groups_whole():
    s = ScalingPolicy()
    assert s.after_loss(survivors=2, free_slots=0, desired=4, multiple=2) == 2
    assert s.after_loss(survivors=2, free_slots=2, desired=4, multiple=2) == 4
    assert s.after_loss(survivors=3, free_slots=0, desired=4, multiple=2) == 2  # one survivor leaves
    assert s.after_loss(survivors=4, free_slots=1, desired=6, multiple=2) == 4
    assert s.after_loss(survivors=1, free_slots=0, desired=4, multiple=2) is None
    assert ScalingPolicy(min_world_size=4).after_loss(survivors=3, free_slots=0, desired=4, multiple=2) is None
    assert s.after_loss(survivors=3, free_slots=0, desired=4) == 3  # flat: unchanged


def test_surviving_group():
    m = mesh(["a"] * 4)
    assert surviving_group(m, {2, 3}) == (0, 1)
    assert surviving_group(m, {0, 1}) == (2, 3)
    assert surviving_group(m, {1}) == (2, 3)
    assert surviving_group(m, {1, 2}) is None
    assert surviving_group(mesh(["a"] * 2), {1}) is None  # one group: no replica
    assert surviving_group(mesh(["a"] * 2), set()) == (0, 1)  # a resize with one group copies it
    # node-major: ranks 0, 2 on node a, 1, 3 on b; G = "node": groups are (0, 2) and (1, 3)
    m2 = plan_mesh(Topology(shard_group_size="node"), ["a", "b", "a", "b"])
    assert surviving_group(m2, {1, 3}) == (0, 2)


def test_plan_restores_every_new_group_from_the_survivors():
    old = mesh(["a"] * 4)
    plan = replica_plan(old, lost={0, 1}, survivors=[2, 3], new=mesh(["a"] * 4))
    assert plan.source == (2, 3)
    # survivors 2, 3 are ranks 0, 1 of the rebuilt pool; new ranks 2, 3 are replacements
    assert [(r.senders, r.receivers) for r in plan.rounds] == [((0, 1), (0, 1)), ((0, 1), (2, 3))]
    alone = replica_plan(old, lost={2, 3}, survivors=[0, 1], new=mesh(["a"] * 2))
    assert [(r.senders, r.receivers) for r in alone.rounds] == [((0, 1), (0, 1))]
    six = replica_plan(mesh(["a"] * 6), lost={1, 4}, survivors=[0, 2, 3, 5], new=mesh(["a"] * 6))
    assert six.source == (2, 3) and [r.receivers for r in six.rounds] == [(0, 1), (2, 3), (4, 5)]
    assert all(r.senders == (1, 2) for r in six.rounds)


def test_plan_refusals_name_the_problem():
    old = mesh(["a"] * 4)
    with pytest.raises(ConfigError, match="no shard group"):
        replica_plan(old, lost={1, 2}, survivors=[0, 3], new=mesh(["a"] * 4))
    with pytest.raises(ConfigError, match="keeps the group size"):
        replica_plan(old, lost={2, 3}, survivors=[0, 1], new=plan_mesh(Topology(shard_group_size=4), ["a"] * 4))
    with pytest.raises(ConfigError, match="kept whole"):
        replica_plan(old, lost={3}, survivors=[0, 2], new=mesh(["a"] * 2))


def test_keep_whole_groups():
    assert keep_whole_groups([0, 2, 3], (2, 3), 2) == [2, 3]
    assert keep_whole_groups([0, 1, 2], (0, 1), 4) == [0, 1, 2]


def test_growing_back_with_shard_groups_adds_whole_groups():
    """A run restored below its size grows back by whole groups, as the room allows; with
    ``"node"`` groups it keeps its size (a group's size would follow Ray's placement)."""
    from zero_ray.driver.recovery import RecoveryController

    class Pool:
        free = 0
        tensor_parallel = 1

        def free_slots(self):
            return self.free

    def controller(topology: Topology, free: int, tensor_parallel: int = 1) -> RecoveryController:
        pool = Pool()
        pool.free, pool.tensor_parallel = free, tensor_parallel
        return RecoveryController(pool, failure=FailurePolicy(), scaling=ScalingPolicy(), desired=6,  # type: ignore[arg-type]
                                  peer_redundancy=False, checkpoint_root=lambda: None, topology=topology)

    groups = Topology(shard_group_size=2)
    assert controller(groups, free=1).grow_target(2) is None  # room for half a group
    assert controller(groups, free=3).grow_target(2) == 4
    assert controller(groups, free=9).grow_target(2) == 6  # never beyond the desired size
    assert controller(Topology(shard_group_size=2, secondary_group_size=2), free=4).grow_target(2) == 6
    assert controller(Topology(shard_group_size="node"), free=9).grow_target(2) is None
    assert controller(Topology(), free=1).grow_target(2) == 3
    # tensor-parallel groups join whole too, with shard groups the least common multiple
    assert controller(Topology(), free=1, tensor_parallel=2).grow_target(2) is None
    assert controller(Topology(), free=3, tensor_parallel=2).grow_target(2) == 4
    assert controller(groups, free=9, tensor_parallel=3).grow_target(0) == 6


def test_checkpoint_restore_keeps_whole_groups():
    """A checkpoint restore at a size rounded down to whole groups lets the surplus survivors go
    (fresh state: any may) instead of giving the rebuilt pool more owners than its size."""
    from zero_ray.driver.recovery import RecoveryController

    calls = []

    class Pool:
        tensor_parallel = 1

        def kill(self, ranks):
            calls.append(("kill", list(ranks)))

        def rebuild(self, survivors, world_size, *, restore):
            calls.append(("rebuild", list(survivors), world_size))

    rc = RecoveryController(Pool(), failure=FailurePolicy(), scaling=ScalingPolicy(), desired=4,  # type: ignore[arg-type]
                            peer_redundancy=False, checkpoint_root=lambda: None,
                            topology=Topology(shard_group_size=2))
    assert rc._restore_from(Source.CHECKPOINT, [0, 1, 2], 2, 0, lambda: 5, lost={3}) == 5
    assert calls == [("kill", [2]), ("rebuild", [0, 1], 2)]
