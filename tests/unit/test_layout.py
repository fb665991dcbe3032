"""FlatLayout: buckets, padding, shard ranges and fragments (pure, milliseconds)."""

from __future__ import annotations

import pytest

from zero_ray.core.flat_layout import FlatLayout
from zero_ray.errors import ConfigError

SPECS = [("a.weight", (3, 4), "float32"), ("a.bias", (3,), "float32"), ("b.weight", (5, 3), "float32"),
         ("b.bias", (5,), "float32")]


def test_by_size_groups_in_reverse_order_and_never_splits_a_parameter() -> None:
    layout = FlatLayout.by_size(SPECS, world_size=2, bucket_numel=20)
    assert [b.params for b in layout.buckets] == [(3, 2), (1, 0)]
    assert layout.numel == 12 + 3 + 15 + 5
    for b in layout.buckets:
        assert b.padded_numel % 2 == 0 and b.padded_numel - b.numel < 2


def test_a_parameter_larger_than_the_bucket_gets_its_own_bucket() -> None:
    layout = FlatLayout.by_size(SPECS, world_size=3, bucket_numel=4)
    assert [b.params for b in layout.buckets] == [(3,), (2,), (1,), (0,)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_tile_every_bucket_and_fragments_cover_every_element_once(world_size: int) -> None:
    layout = FlatLayout.by_size(SPECS, world_size=world_size, bucket_numel=20)
    covered = {p.name: [0] * p.numel for p in layout.params}
    for b in layout.buckets:
        ends = [b.shard_range(r) for r in range(world_size)]
        assert ends[0][0] == 0 and ends[-1][1] == b.padded_numel
        assert all(ends[r][1] == ends[r + 1][0] for r in range(world_size - 1))
        for r in range(world_size):
            for f in layout.shard_fragments(b.index, r):
                assert f.local_end - f.local_start == f.param_end - f.param_start
                for k in range(f.param_start, f.param_end):
                    covered[layout.params[f.param].name][k] += 1
    assert all(c == 1 for counts in covered.values() for c in counts)
    assert sum(layout.real_shard_numel(r) for r in range(world_size)) == layout.numel
    assert layout.shard_numel * world_size == layout.padded_numel


def test_bad_groups_and_sizes_are_rejected_with_their_values() -> None:
    with pytest.raises(ConfigError, match="world_size=0"):
        FlatLayout.by_size(SPECS, world_size=0, bucket_numel=4)
    with pytest.raises(ConfigError, match="bucket_numel=0"):
        FlatLayout.by_size(SPECS, world_size=1, bucket_numel=0)
    with pytest.raises(ConfigError, match="exactly once"):
        FlatLayout.build(SPECS, world_size=1, groups=[[0, 1], [1, 2, 3]])
    with pytest.raises(ConfigError, match="rank=2"):
        FlatLayout.by_size(SPECS, world_size=2, bucket_numel=4).buckets[0].shard_range(2)
