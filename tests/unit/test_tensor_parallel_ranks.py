"""Which ranks form which groups under tensor parallelism (core/tensor_parallel_ranks.py): TP
groups of consecutive ranks, data-parallel groups strided by T, every rank in exactly one of
each, and the shares of the step's sums (norm squares, loss items). Pure: milliseconds."""

from __future__ import annotations

import pytest

from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
from zero_ray.errors import ConfigError


def test_groups_at_two_by_two() -> None:
    ranks = TensorParallelRanks(world_size=4, size=2)
    assert ranks.data_parallel == 2
    assert [ranks.tp_members(r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [ranks.dp_members(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [(ranks.tp_rank(r), ranks.dp_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize(("world", "size"), [(1, 1), (2, 2), (4, 4), (4, 1), (6, 2), (6, 3), (16, 4)])
def test_each_rank_is_in_one_group_of_each_kind_and_groups_cross_once(world: int, size: int) -> None:
    ranks = TensorParallelRanks(world_size=world, size=size)
    tp = {ranks.tp_members(r) for r in range(world)}
    dp = {ranks.dp_members(r) for r in range(world)}
    assert len(tp) == world // size and len(dp) == size
    assert sorted(r for g in tp for r in g) == sorted(r for g in dp for r in g) == list(range(world))
    assert all(len(set(a) & set(b)) == 1 for a in tp for b in dp)  # a TP rank of a DP rank: one owner
    for r in range(world):
        # consecutive TP groups: a node of a multiple of T owners holds whole groups
        members = ranks.tp_members(r)
        assert members == tuple(range(members[0], members[0] + size)) and members[0] % size == 0
        assert ranks.tp_members(r)[ranks.tp_rank(r)] == r and ranks.dp_members(r)[ranks.dp_rank(r)] == r


def test_squares_count_a_replicated_parameter_once() -> None:
    ranks = TensorParallelRanks(world_size=4, size=2)
    # A sharded matrix split 3 + 5 over the TP ranks, a norm weight of 4 on both; partitioned over DP (halves).
    sharded = {0: 1.0, 1: 2.5, 2: 2.0, 3: 2.5}
    replicated = {0: 1.5, 1: 1.5, 2: 2.5, 3: 2.5}
    total = sum(ranks.squares_share(r, sharded=sharded[r], replicated=replicated[r], whole=False) for r in range(4))
    assert total == pytest.approx(8.0 + 4.0)
    # stage 0: every DP rank holds the whole reduced gradient of its shard
    whole = sum(ranks.squares_share(r, sharded=3.0 if r % 2 == 0 else 5.0, replicated=4.0, whole=True)
                for r in range(4))
    assert whole == pytest.approx(12.0)


def test_only_the_first_tp_rank_counts_loss_items() -> None:
    ranks = TensorParallelRanks(world_size=6, size=3)
    assert sum(ranks.count_share(r, 10.0) for r in range(6)) == 20.0


def test_refusals_name_the_values() -> None:
    with pytest.raises(ConfigError, match=r"world_size=6 is not divisible by tensor_parallel size=4.*4 or 8"):
        TensorParallelRanks(world_size=6, size=4)
    with pytest.raises(ConfigError, match="size=0 must be an integer >= 1"):
        TensorParallelRanks(world_size=4, size=0)
    with pytest.raises(ConfigError, match="rank=4 is outside the world of 4 ranks"):
        TensorParallelRanks(world_size=4, size=2).tp_members(4)
