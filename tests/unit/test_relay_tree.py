"""The relay tree's plan (zero_ray/core/relay_tree.py): one relay per node, no relay or driver over
fan_out children, the least depth, every live rank reached once, and losses that move nothing
they need not."""

from __future__ import annotations

import math
import random
import re

import pytest

from zero_ray.core.relay_tree import MAX_FAN_OUT, RelayConfig, RelayTree, plan_relays
from zero_ray.errors import ConfigError, RelayError


def _nodes(world: int, per_node: int = 8) -> list[str]:
    return [f"node-{r // per_node}" for r in range(world)]


def _least_depth(nodes: list[str], f: int) -> int:
    """The least depth of any tree with one relay per node, from Kraft's inequality: a node of
    k ranks is a subtree of height max(1, ceil(log_f k)), and the driver holds f ** (D + 1)."""
    sizes: dict[str, int] = {}
    for n in nodes:
        sizes[n] = sizes.get(n, 0) + 1
    heights = []
    for k in sizes.values():
        h = 1
        while f ** h < k:
            h += 1
        heights.append(h)
    d = max(heights)
    while sum(f ** h for h in heights) > f ** (d + 1):
        d += 1
    return d


def _reached(tree: RelayTree) -> list[int]:
    return sorted(r for relay in tree.relays for r in relay.ranks)


@pytest.mark.parametrize("world", [1, 8, 9, 64, 1024, 8192])
@pytest.mark.parametrize("fan_out", [2, 3, 4, 8, 16])
def test_every_rank_is_reached_once_within_fan_out_at_the_least_depth(world: int, fan_out: int) -> None:
    nodes = _nodes(world)
    tree = plan_relays(nodes, RelayConfig(fan_out=fan_out))
    assert _reached(tree) == list(range(world))
    assert len(tree.top) <= fan_out
    assert all(r.children <= fan_out for r in tree.relays)
    assert tree.depth == _least_depth(nodes, fan_out)
    assert all(len(tree.path(r)) <= tree.depth for r in (0, world // 2, world - 1))
    # one relay per node, on its lowest rank, whose subtree is the node's ranks
    by_node: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        by_node.setdefault(n, []).append(r)
    for node, ranks in by_node.items():
        head = tree.node_relay(node)
        assert head.host == ranks[0]
        assert all(head in tree.path(r) for r in ranks)


def test_known_shapes() -> None:
    # 8 ranks on one node: the driver calls the node's relay on rank 0, which calls all 8
    one = plan_relays(_nodes(8))
    assert [(r.host, r.ranks) for r in one.driver_children] == [(0, tuple(range(8)))]
    assert one.depth == 1
    # 9 nodes of 8 and fan-out 8: two relays above the nodes, 5 and 4 nodes under them
    nine = plan_relays(_nodes(72))
    assert [(r.host, r.node, len(r.relays)) for r in nine.driver_children] == [(0, None, 5), (40, None, 4)]
    assert [r.host for r in nine.path(71)] == [40, 64]
    # 1,024 ranks = 128 nodes: 16 relays of 8 nodes under 2 of 8 under the driver
    big = plan_relays(_nodes(1024))
    assert big.depth == 3 and len(big.top) == 2
    assert [r.host for r in big.path(1023)] == [512, 960, 1016]
    assert [r.level for r in big.path(1023)] == [3, 2, 1]
    # a node of 8 under fan-out 2: the node's relay over relays over pairs of ranks
    deep = plan_relays(_nodes(8), RelayConfig(fan_out=2))
    assert [(r.host, r.node, r.level) for r in deep.path(7)] == [(0, "node-0", 3), (4, "node-0", 2), (6, "node-0", 1)]
    assert deep.path(7)[-1].ranks == (6, 7)


def test_uneven_and_interleaved_nodes() -> None:
    # after a resize the ranks of a node need not be contiguous; sizes differ
    nodes = ["a", "b", "a", "c", "b", "a"] + ["d"] * 20 + ["e"]
    for f in range(2, 17):
        tree = plan_relays(nodes, RelayConfig(fan_out=f))
        assert _reached(tree) == list(range(len(nodes)))
        assert tree.depth == _least_depth(nodes, f)
        assert all(r.children <= f for r in tree.relays) and len(tree.top) <= f
        assert tree.node_relay("a").host == 0 and tree.node_relay("b").host == 1 and tree.node_relay("e").host == 26
        assert set(tree.node_relay("a").ranks or ()) <= {0, 2, 5}
    # fan-out 4: d's 20 ranks are a subtree of height 3, the small nodes' relays go under one relay
    tree = plan_relays(nodes, RelayConfig(fan_out=4))
    assert tree.depth == 3
    assert tree.path(0)[-1].ranks == (0, 2, 5)


@pytest.mark.parametrize("seed", range(20))
def test_random_node_layouts_meet_the_least_depth(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [f"n{rng.randrange(rng.randint(1, 40))}" for _ in range(rng.randint(1, 300))]
    f = rng.randint(2, 16)
    tree = plan_relays(nodes, RelayConfig(fan_out=f))
    assert _reached(tree) == list(range(len(nodes)))
    assert tree.depth == _least_depth(nodes, f)
    assert plan_relays(nodes, RelayConfig(fan_out=f)) == tree  # deterministic


def test_losing_a_node_relay_moves_it_to_the_next_lowest_rank_of_its_node() -> None:
    tree = plan_relays(_nodes(64))
    after = tree.reparent(8)  # node-1's relay
    assert after.node_relay("node-1").host == 9
    assert after.node_relay("node-1").ranks == tuple(range(9, 16))
    assert after.node_relay("node-1").id == tree.node_relay("node-1").id
    assert _reached(after) == [r for r in range(64) if r != 8]
    assert after.lost == {8}
    # nothing else moved
    same = [r for r in tree.relays if r.id != tree.node_relay("node-1").id]
    assert all(after.relay(r.id) == r for r in same)
    with pytest.raises(RelayError, match="rank 8 .*was lost"):
        after.path(8)
    with pytest.raises(RelayError, match="rank 8 cannot be lost.*it was lost"):
        after.reparent(8)


def test_losing_rank_0_moves_every_relay_it_ran() -> None:
    tree = plan_relays(_nodes(1024))
    assert [r.level for r in tree.hosted_by(0)] == [1, 2, 3]
    after = tree.reparent(0)
    assert [r.level for r in after.hosted_by(1)] == [1, 2, 3]
    assert after.hosted_by(0) == ()
    assert [r.host for r in after.path(5)] == [1, 1, 1]
    assert after.depth == 3


def test_a_whole_node_lost_takes_its_relay_and_its_upper_relays_move_to_another_node() -> None:
    tree = plan_relays(_nodes(1024))
    after = tree
    for r in range(8):  # node-0, which ran a relay on every level
        after = after.reparent(r)
    assert _reached(after) == list(range(8, 1024))
    with pytest.raises(RelayError, match="node 'node-0' has no live rank"):
        after.node_relay("node-0")
    assert [r.host for r in after.path(8)] == [8, 8, 8]
    assert all(r.children <= 8 for r in after.relays) and len(after.top) <= 8


def test_an_upper_relay_left_with_one_child_is_replaced_by_it() -> None:
    nine = plan_relays(_nodes(72))  # the driver -> [5 nodes], [4 nodes]
    after = nine
    for r in range(40, 64):  # three of the second relay's four nodes
        after = after.reparent(r)
    # the relay over node-8 alone is gone: node-8's relay moved up to the driver
    assert [(r.node, r.host) for r in after.driver_children] == [(None, 0), ("node-8", 64)]
    assert [r.host for r in after.path(70)] == [64]
    assert after.depth == 2


def test_the_driver_calls_the_children_of_its_one_relay() -> None:
    nine = plan_relays(_nodes(72))
    after = nine
    for r in range(40, 72):  # the second relay's nodes, all of them
        after = after.reparent(r)
    assert [(r.node, r.host) for r in after.driver_children] == [(f"node-{i}", 8 * i) for i in range(5)]
    assert after.depth == 1


def test_inside_a_node_the_node_relay_stays_and_takes_its_one_child_s_children() -> None:
    tree = plan_relays(_nodes(4), RelayConfig(fan_out=2))  # node relay on 0 over (0, 1) and (2, 3)
    after = tree.reparent(0).reparent(1)
    head = after.node_relay("node-0")
    assert head.id == tree.node_relay("node-0").id
    assert (head.host, head.ranks, head.level) == (2, (2, 3), 1)
    assert after.depth == 1


@pytest.mark.parametrize("seed", range(10))
def test_random_losses_never_orphan_a_rank_nor_exceed_fan_out(seed: int) -> None:
    rng = random.Random(seed)
    nodes = _nodes(rng.choice([9, 64, 200]), rng.choice([1, 4, 8]))
    f = rng.randint(2, 9)
    tree = plan_relays(nodes, RelayConfig(fan_out=f))
    live = list(range(len(nodes)))
    depth = tree.depth
    for _ in range(len(nodes) - 1):
        lost = live.pop(rng.randrange(len(live)))
        tree = tree.reparent(lost)  # RelayTree checks every invariant as it is built
        assert _reached(tree) == sorted(live)
        assert tree.depth <= depth
        depth = tree.depth
        assert all(tree.path(r)[0] in tree.driver_children for r in live[:3])
    with pytest.raises(RelayError, match="last live rank"):
        tree.reparent(live[0])


@pytest.mark.parametrize("bad", [0, 1, -3, MAX_FAN_OUT + 1, True, 2.0, "8"])
def test_bad_configs_name_the_value_and_the_range(bad: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"RelayConfig(fan_out={bad!r}) must be an integer from 2 to "
                                                    f"{MAX_FAN_OUT}")):
        RelayConfig(fan_out=bad)  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="at least one rank"):
        plan_relays([])
    with pytest.raises(ConfigError, match="rank 1's node is 7"):
        plan_relays(["a", 7])  # type: ignore[list-item]
    tree = plan_relays(_nodes(16))
    with pytest.raises(RelayError, match="rank 16 cannot be lost .*planned for ranks 0..15"):
        tree.reparent(16)
    with pytest.raises(RelayError, match="no relay 99"):
        tree.relay(99)


def test_a_broken_tree_is_refused() -> None:
    tree = plan_relays(_nodes(16))
    with pytest.raises(RelayError, match="not the live ranks"):
        RelayTree(fan_out=8, nodes=tree.nodes, relays=tree.relays[:1], top=tree.top[:1])
    with pytest.raises(RelayError, match="over fan_out=1"):
        RelayTree(fan_out=1, nodes=tree.nodes, relays=tree.relays, top=tree.top)


def test_depth_grows_with_the_log_of_nodes() -> None:
    for nodes in (1, 8, 64, 512):
        tree = plan_relays(_nodes(8 * nodes))
        assert tree.depth == max(1, math.ceil(math.log(nodes, 8) - 1e-9))


def test_ranks_under_a_relay_are_its_subtree_s() -> None:
    tree = plan_relays([f"n{r // 8}" for r in range(64)], RelayConfig(fan_out=2))
    tops = [tree.ranks_under(r.id) for r in tree.driver_children]
    assert sorted(r for under in tops for r in under) == list(range(64))
    for relay in tree.relays:
        below = relay.ranks + tuple(r for c in tree.children(relay.id) for r in tree.ranks_under(c.id))
        assert tree.ranks_under(relay.id) == tuple(sorted(below)) and relay.host == min(below)



def _around_reaches(tree: RelayTree, lost: set[int]) -> tuple[list[int], set[int]]:
    relays, direct = tree.around(lost)
    reached = [r for relay in relays for r in tree.ranks_under(relay.id)] + list(direct)
    hosts = {relay.host for relay in relays}
    return sorted(reached), hosts


def test_around_a_lost_relay_host_the_survivors_are_reached_once_by_few_calls_none_through_it() -> None:
    # rank 7680 hosts node-960's relay and the two above it, up to a top relay's child (8,192
    # owners, depth 4; control_scale's stand-in victim): the survivors' abort must not pass through it.
    tree = plan_relays(_nodes(8192))
    victim = 7680
    assert [r.level for r in tree.hosted_by(victim)] == [1, 2, 3]
    relays, direct = tree.around({victim})
    reached, hosts = _around_reaches(tree, {victim})
    assert reached == [r for r in range(8192) if r != victim]  # every survivor, once
    assert victim not in hosts and not {r.id for r in tree.hosted_by(victim)} & {r.id for r in relays}
    assert direct == tuple(range(7681, 7688))  # the lost node relay's own owners
    assert len(relays) <= (8 - 1) * tree.depth + 1  # siblings along the path, not O(owners)
    assert tree.around(set()) == (tree.driver_children, ())  # no loss: the driver's children whole


@pytest.mark.parametrize("seed", range(6))
def test_around_random_losses_reaches_every_other_live_rank_once_through_no_lost_rank(seed: int) -> None:
    rng = random.Random(seed)
    nodes = _nodes(rng.choice([9, 64, 300]), rng.choice([1, 4, 8]))
    tree = plan_relays(nodes, RelayConfig(fan_out=rng.randint(2, 9)))
    lost = set(rng.sample(range(len(nodes)), rng.randint(1, 5))) | {len(nodes) + 3}  # one not in the tree
    reached, hosts = _around_reaches(tree, lost)
    assert reached == [r for r in range(len(nodes)) if r not in lost]
    relays, _ = tree.around(lost)
    assert all(not set(tree.ranks_under(relay.id)) & lost for relay in relays) and not hosts & lost
