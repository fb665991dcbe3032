"""The live reshard plan (pure): every new range covered exactly once, from its old owner."""

from __future__ import annotations

import pytest

from zero_ray.core.reshard_plan import bucket_range, bytes_moved, plan_moves
from zero_ray.errors import ConfigError


@pytest.mark.parametrize("old,new", [(1, 4), (2, 4), (4, 3), (3, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("whole", [False, True])
def test_every_new_range_is_covered_once_by_its_old_owner(old: int, new: int, whole: bool) -> None:
    numels = [17, 5, 64, 1]
    moves = plan_moves(numels, old_world=old, new_world=new, whole=whole)
    for b, numel in enumerate(numels):
        old_shard = bucket_range(numel, old, 0, whole=False)[1]
        for dst in range(new):
            lo, hi = bucket_range(numel, new, dst, whole=whole)
            got = sorted((m.start, m.end) for m in moves if m.bucket == b and m.dst == dst)
            covered = [i for s, e in got for i in range(s, e)]
            assert covered == list(range(lo, min(hi, numel)))  # padding is never sent
        for m in (m for m in moves if m.bucket == b):
            assert m.src * old_shard <= m.start < m.end <= (m.src + 1) * old_shard


def test_only_ranges_that_change_owner_cross_actors() -> None:
    # 16 elements, 2 -> 4 ranks: rank 0 keeps [0, 4), rank 1's [8, 12) goes to rank 2, etc.
    moves = plan_moves([16], old_world=2, new_world=4, whole=False)
    assert [(m.start, m.end, m.src, m.dst) for m in moves] == [(0, 4, 0, 0), (4, 8, 0, 1), (8, 12, 1, 2),
                                                                (12, 16, 1, 3)]
    assert bytes_moved(moves, element_bytes=4) == {0: 16, 1: 32}
    assert plan_moves([16], old_world=2, new_world=2, whole=False) == [m for m in plan_moves(
        [16], old_world=2, new_world=2, whole=False) if m.local]


def test_world_sizes_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="old_world=0"):
        plan_moves([4], old_world=0, new_world=2, whole=False)


def test_backups_are_a_bijection_on_other_nodes_when_possible() -> None:
    from zero_ray.core.reshard_plan import backup_peers

    nodes = ["a", "a", "b", "b"]
    backup = backup_peers(nodes)
    assert sorted(backup) == [0, 1, 2, 3]
    assert all(nodes[backup[r]] != nodes[r] for r in range(4))
    assert backup_peers(["a", "a", "a"]) == [1, 2, 0]  # one node: the next rank
    assert backup_peers(["x"]) == [0]
    three = backup_peers(["a", "a", "b"])
    assert sorted(three) == [0, 1, 2]
