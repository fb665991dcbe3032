"""Where new owners go (core/placement.py): pure, no Ray."""

from __future__ import annotations

import pytest

from zero_ray.core.placement import NodeRoom, Target, place
from zero_ray.errors import ResourceError

CPU = {"CPU": 1.0}
NODES = [NodeRoom(node_id="b", total={"CPU": 4.0}), NodeRoom(node_id="a", total={"CPU": 2.0}),
         NodeRoom(node_id="c", total={"CPU": 1.0})]


def test_pack_and_spread_leave_the_node_to_ray() -> None:
    assert place("PACK", count=2, demand=CPU, nodes=NODES, occupied=[]) == [Target(), Target()]
    assert place("SPREAD", count=1, demand=CPU, nodes=NODES, occupied=["a"]) == [Target(spread=True)]


def test_strict_pack_keeps_every_owner_on_the_first_ones_node() -> None:
    assert place("STRICT_PACK", count=3, demand=CPU, nodes=NODES, occupied=[]) == [Target(node="b")] * 3
    assert place("STRICT_PACK", count=1, demand=CPU, nodes=NODES, occupied=["a"]) == [Target(node="a")]
    with pytest.raises(ResourceError, match="node a has .* not enough for 3 owners"):
        place("STRICT_PACK", count=2, demand=CPU, nodes=NODES, occupied=["a"])
    with pytest.raises(ResourceError, match="no node has room for 5 owners"):
        place("STRICT_PACK", count=5, demand=CPU, nodes=NODES, occupied=[])
    with pytest.raises(ResourceError, match="node z is gone"):
        place("STRICT_PACK", count=1, demand=CPU, nodes=NODES, occupied=["z"])


def test_strict_spread_gives_each_owner_a_node_of_its_own() -> None:
    assert place("STRICT_SPREAD", count=2, demand=CPU, nodes=NODES, occupied=["b"]) == \
        [Target(node="a"), Target(node="c")]
    # a replacement goes to the node its lost predecessor left free
    assert place("STRICT_SPREAD", count=1, demand=CPU, nodes=NODES, occupied=["a", "b"]) == [Target(node="c")]
    with pytest.raises(ResourceError, match="2 more owners need as many nodes without one, but 1 are left"):
        place("STRICT_SPREAD", count=2, demand=CPU, nodes=NODES, occupied=["a", "b"])
    gpu = {"GPU": 1.0, "CPU": 1.0}
    with pytest.raises(ResourceError):
        place("STRICT_SPREAD", count=1, demand=gpu, nodes=NODES, occupied=[])


def test_an_unknown_strategy_is_named() -> None:
    with pytest.raises(ResourceError, match="placement_strategy='RANDOM'"):
        place("RANDOM", count=1, demand=CPU, nodes=NODES, occupied=[])
