"""Where new owners go (core/placement.py): pure, no Ray."""

from __future__ import annotations

import pytest

from zero_ray.core.placement import GroupedSurvivors, NodeRoom, Target, group_survivors, place, place_groups
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


# -- tensor-parallel groups: T consecutive ranks share a node (issue 45) --------------------------
# This machine is one node, where every group is on one node trivially: the plan is tested here.

def test_each_tp_group_is_pinned_to_one_node_packing_nodes_in_turn() -> None:
    nodes = [NodeRoom(node_id="n1", total={"CPU": 4.0}), NodeRoom(node_id="n0", total={"CPU": 4.0})]
    targets = place_groups("PACK", ranks=range(8), group_size=2, demand=CPU, nodes=nodes, occupied=[])
    # PACK fills a node with whole groups before the next (nodes in id order)
    assert [t.node for t in targets] == ["n0"] * 4 + ["n1"] * 4
    spread = place_groups("SPREAD", ranks=range(8), group_size=2, demand=CPU, nodes=nodes, occupied=[])
    assert [t.node for t in spread] == ["n0", "n0", "n1", "n1"] * 2  # groups alternate, never split


def test_a_group_never_straddles_nodes_even_where_single_owners_would_fit() -> None:
    # 3 CPUs per node, groups of 2: each node takes one group, the third CPU stays free, and a
    # third group finds no node with room for both its owners
    nodes = [NodeRoom(node_id=f"n{i}", total={"CPU": 3.0}) for i in range(2)]
    targets = place_groups("PACK", ranks=range(4), group_size=2, demand=CPU, nodes=nodes, occupied=[])
    assert [t.node for t in targets] == ["n0", "n0", "n1", "n1"]
    with pytest.raises(ResourceError, match="no node has room for a tensor-parallel group of 2 owners"):
        place_groups("PACK", ranks=range(6), group_size=2, demand=CPU, nodes=nodes, occupied=[])


def test_a_grow_adds_whole_groups_and_a_replacement_joins_its_group_s_node() -> None:
    nodes = [NodeRoom(node_id="n0", total={"CPU": 4.0}), NodeRoom(node_id="n1", total={"CPU": 4.0})]
    occupied = ["n1", "n1", "n0", "n0"]  # groups 0 and 1, placed earlier
    grow = place_groups("PACK", ranks=range(4, 8), group_size=2, demand=CPU, nodes=nodes, occupied=occupied)
    assert [t.node for t in grow] == ["n0", "n0", "n1", "n1"]
    # rank 3 replaced: it goes where rank 2, its group's other member, is
    assert place_groups("SPREAD", ranks=range(3, 4), group_size=2, demand=CPU, nodes=nodes,
                        occupied=occupied) == [Target(node="n0")]


def test_strategies_that_cannot_keep_groups_whole_are_named_and_size_one_is_place() -> None:
    with pytest.raises(ResourceError, match="STRICT_SPREAD.*groups of 2"):
        place_groups("STRICT_SPREAD", ranks=range(2), group_size=2, demand=CPU, nodes=NODES, occupied=[])
    assert place_groups("PACK", ranks=range(3), group_size=1, demand=CPU, nodes=NODES,
                        occupied=[]) == place("PACK", count=3, demand=CPU, nodes=NODES, occupied=[])
    # STRICT_PACK: every owner on one node already, groups included
    assert {t.node for t in place_groups("STRICT_PACK", ranks=range(4), group_size=2, demand=CPU, nodes=NODES,
                                         occupied=[])} == {"b"}


# -- after a loss: which survivors go on, in which positions (group_survivors) -----------------------
def _check_node_local(grouped: GroupedSurvivors, nodes: list[str], size: int) -> None:
    """Every group of kept survivors is on one node; at most the last is short (new owners, pinned
    to its node by place_groups, complete it)."""
    groups = [grouped.kept[i:i + size] for i in range(0, len(grouped.kept), size)]
    assert all(len({nodes[r] for r in g}) == 1 for g in groups), groups
    assert all(len(g) == size for g in groups[:-1])


def test_a_restore_never_joins_two_old_groups_remainders_across_nodes() -> None:
    # (T, D) = (2, 3), one TP group per node; TP rank 1 of group 0 lost. Kept in order, owners 0
    # (node a) and 2 (node b) would form the first new group.
    nodes = ["a", "a", "b", "b", "c", "c"]
    survivors = [0, 2, 3, 4, 5]
    on_survivors = group_survivors(survivors, nodes, group_size=2, target=4)
    assert on_survivors == GroupedSurvivors(kept=(2, 3, 4, 5), leaving=(0,))
    _check_node_local(on_survivors, nodes, 2)
    # with a replacement: owner 0's group completed by the new owner at position 5, on node a;
    # intact groups keep their owners' TP ranks (position parity)
    grown = group_survivors(survivors, nodes, group_size=2, target=6)
    assert grown == GroupedSurvivors(kept=(2, 3, 4, 5, 0), leaving=())
    assert all(p % 2 == r % 2 for p, r in enumerate(grown.kept))
    _check_node_local(grown, nodes, 2)


def test_remainders_beyond_one_leave_and_the_fullest_remainder_stays() -> None:
    # T = 4, two groups per node: node a lost two owners of group 0, node b one of group 3
    nodes = ["a"] * 8 + ["b"] * 8
    survivors = [0, 1, *range(4, 15)]  # 2, 3 and 15 lost
    got = group_survivors(survivors, nodes, group_size=4, target=16)
    # whole groups (4-7 on a, 8-11 on b) first; b's remainder 12-14 (3 survivors) beats a's 0, 1
    assert got == GroupedSurvivors(kept=(4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14), leaving=(0, 1))
    _check_node_local(got, nodes, 4)
    # on one node, survivors of two groups do form one (the node holds them all), after the
    # intact group's positions are settled: here every owner keeps its TP rank
    one_node = group_survivors([0, 2, 3, 5], ["n"] * 6, group_size=2, target=4)
    assert one_node == GroupedSurvivors(kept=(0, 5, 2, 3), leaving=())
    assert all(p % 2 == r % 2 for p, r in enumerate(one_node.kept))


def _keeps_every_copy(grouped: GroupedSurvivors, copies: dict[int, set[int]], world: int) -> bool:
    return set().union(*(copies[r] for r in grouped.kept)) == set(range(world))


def test_a_shrink_keeps_the_only_holders_of_lost_ranks_copies() -> None:
    # (T, D) = (2, 4), one TP group per node, backups one node on (backup_peers: [2, 3, 4, 5, 6, 7,
    # 0, 1]); owner 0 lost and the run shrinks to 2 groups. By rank, groups (2, 3) and (4, 5) would
    # go on, and nobody kept would hold old ranks 6 and 7 (their copies were on 0 and 1).
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    backup = [2, 3, 4, 5, 6, 7, 0, 1]
    survivors = [1, 2, 3, 4, 5, 6, 7]
    copies = {r: {r} | {w for w, b in enumerate(backup) if b == r} for r in survivors}
    by_rank = group_survivors(survivors, nodes, group_size=2, target=4)
    assert by_rank.kept == (2, 3, 4, 5) and not _keeps_every_copy(by_rank, copies, 8)
    got = group_survivors(survivors, nodes, group_size=2, target=4, copies=copies)
    assert got == GroupedSurvivors(kept=(2, 3, 6, 7), leaving=(1, 4, 5))
    assert _keeps_every_copy(got, copies, 8)
    assert all(p % 2 == r % 2 for p, r in enumerate(got.kept))  # intact groups keep their TP ranks
    _check_node_local(got, nodes, 2)


def test_the_remainder_kept_is_the_one_holding_a_copy_no_one_else_does() -> None:
    # (2, 3), a group per node; owners 1 and 4 lost. Group (2, 3) goes on whole; of the remainders
    # (0 on a, 5 on c), by rank 0 would stay, but only 5 holds old rank 1's copy.
    nodes = ["a", "a", "b", "b", "c", "c"]
    copies = {0: {0}, 2: {2, 0, 4}, 3: {3, 5}, 5: {5, 1}}
    assert group_survivors([0, 2, 3, 5], nodes, group_size=2, target=4).kept == (2, 3, 0)
    got = group_survivors([0, 2, 3, 5], nodes, group_size=2, target=4, copies=copies)
    assert got == GroupedSurvivors(kept=(2, 3, 5), leaving=(0,))
    assert _keeps_every_copy(got, copies, 6)
    # where the copies do not decide, the order is the one without them
    own = {r: {r} for r in (0, 2, 3, 5)}
    assert group_survivors([0, 2, 3, 5], nodes, group_size=2, target=4, copies=own).kept == (2, 3, 0)


def test_size_one_keeps_the_lowest_ranks_and_a_target_of_part_groups_is_refused() -> None:
    assert group_survivors([0, 2, 3, 5], ["a", "a", "b", "b", "c", "c"], group_size=1, target=3) == \
        GroupedSurvivors(kept=(0, 2, 3), leaving=(5,))
    with pytest.raises(ResourceError, match="3 owners are not whole tensor-parallel groups of 2"):
        group_survivors([0, 1, 2], ["a"] * 4, group_size=2, target=3)
