"""The data a step hands each owner under tensor parallelism (issue 45): the global batch is cut
for the D = world_size / T data-parallel ranks, and every owner of TP group d gets data-parallel
rank d's piece (driver/batch_staging.py). Pure: fit's packed indices, no Ray."""

from __future__ import annotations

import pytest

from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
from zero_ray.driver.batch_staging import IndexedBatch, per_owner
from zero_ray.errors import ConfigError


def test_every_tp_rank_of_a_data_parallel_rank_gets_its_indices() -> None:
    work = IndexedBatch("train", tuple(range(100, 107)))  # 7 samples over D = 2: 4 and 3
    out = work.split(world_size=4, key="k", tensor_parallel=2)
    assert out.counts == (4, 4, 3, 3)
    assert [p.indices for p in out.pieces] == [(100, 101, 102, 103)] * 2 + [(104, 105, 106)] * 2
    # the same global batch, each sample read by exactly one data-parallel rank
    readers = [p.indices for r, p in enumerate(out.pieces) if r % 2 == 0]
    assert sorted(i for piece in readers for i in piece) == list(work.indices)


def test_without_tensor_parallelism_each_owner_reads_its_own_share() -> None:
    work = IndexedBatch("train", tuple(range(6)))
    out = work.split(world_size=3, key="k")
    assert out.counts == (2, 2, 2) and out.indices == work.indices
    assert [p.indices for p in out.pieces] == [(0, 1), (2, 3), (4, 5)]
    assert out == work.split(world_size=3, key="k", tensor_parallel=1)


def test_a_data_parallel_rank_s_piece_is_repeated_for_each_of_its_owners() -> None:
    assert per_owner(["a", "b"], TensorParallelRanks(world_size=6, size=3)) == ["a"] * 3 + ["b"] * 3
    with pytest.raises(ConfigError, match="world_size=3 is not divisible by tensor_parallel size=2"):
        IndexedBatch("train", (0, 1, 2)).split(world_size=3, key="k", tensor_parallel=2)


def test_down_the_relay_tree_each_tp_rank_reads_back_its_data_parallel_rank_s_indices() -> None:
    from zero_ray.control.handlers import StepArgs
    from zero_ray.driver.batch_staging import StepCommand

    work = IndexedBatch("train", tuple(range(50, 60)))  # 10 samples over D = 3 (T = 2): 4, 3, 3
    out = work.split(world_size=6, key="1:0", tensor_parallel=2)
    command = StepCommand(step=StepArgs(step=0, piece=out.piece, global_samples=10), out=out)
    relayed = command.relayed(timeout_s=1.0)
    assert [relayed.rank_step(r) for r in range(6)] == command.per_rank()
    node = relayed.for_ranks([2, 3], timeout_s=0.5, relay=2)  # one TP group's node
    assert [node.rank_step(r).piece.indices for r in (2, 3)] == [(54, 55, 56)] * 2


def test_sizes_and_per_owner_values_match_their_per_rank_definitions() -> None:
    # split_sizes and per_owner at T = 1 skip their per-part loops (the driver's, every step)
    from zero_ray.core.batching import split_sizes
    from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
    from zero_ray.driver.batch_staging import per_owner

    for total, parts in [(0, 1), (5, 5), (13, 5), (4096, 1024), (7, 3), (2, 8)]:
        base, extra = divmod(total, parts)
        assert split_sizes(total, parts) == [base + (1 if i < extra else 0) for i in range(parts)]
    for world, t in [(8, 1), (8, 2), (12, 4), (1, 1)]:
        ranks = TensorParallelRanks(world_size=world, size=t)
        values = list(range(100, 100 + world // t))
        assert per_owner(values, ranks) == [values[r // t] for r in range(world)]
