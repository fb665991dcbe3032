"""Where new owners go, by the run's placement strategy (pure).

Owners are plain Ray actors that ask for their slot (one GPU, or ``num_cpus_per_owner`` CPUs)
themselves: a slot is held exactly as long as its owner lives, so a lost or removed owner gives
it back at once and a replacement can take it (a placement group would keep a dead owner's
bundle reserved until the whole group is removed). The strategies keep their placement-group
meaning across owners: PACK and SPREAD are Ray's own scheduling (best effort); STRICT_PACK puts
every owner on one node, STRICT_SPREAD every owner on a node of its own, pinned by node.

Tensor parallelism (``place_groups``): the T owners of a TP group (ranks ``d T .. d T + T - 1``)
run a layer's all-reduces on every layer, so a group never straddles nodes. Each new group is
pinned to one node with room for all T of its owners (PACK: the fullest such node, so groups
fill a node before the next; SPREAD: the emptiest), and a group's new members join the node its
other members are on. Ray's own PACK is best effort and could split a group, so groups are
pinned by node under either strategy; STRICT_PACK already puts every owner on one node.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from zero_ray.errors import ResourceError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class NodeRoom:
    """A live node and the resources it has in total."""

    node_id: str
    total: Mapping[str, float]

    def fits(self, demand: Mapping[str, float], count: int) -> bool:
        return all(self.total.get(k, 0.0) >= v * count for k, v in demand.items())


@dataclass(frozen=True, kw_only=True)
class Target:
    """How to schedule one new owner: on ``node`` (pinned) or anywhere, Ray spreading or not."""

    node: str | None = None
    spread: bool = False


def place(strategy: str, *, count: int, demand: Mapping[str, float], nodes: Sequence[NodeRoom],
          occupied: Sequence[str]) -> list[Target]:
    """Targets for ``count`` new owners, each needing ``demand``, given the live ``nodes`` and
    the nodes the run's current owners are on (``occupied``, one entry per owner)."""
    if strategy not in STRATEGIES:
        raise ResourceError(f"placement_strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "PACK":
        return [Target() for _ in range(count)]
    if strategy == "SPREAD":
        return [Target(spread=True) for _ in range(count)]
    if strategy == "STRICT_PACK":
        if occupied:
            home = occupied[0]
            if any(n != home for n in occupied):
                raise ResourceError(f"STRICT_PACK owners are on several nodes ({sorted(set(occupied))})")
            room = next((n for n in nodes if n.node_id == home), None)
            if room is None:
                raise ResourceError(f"STRICT_PACK: the owners' node {home} is gone; no new owner can join them")
            if not room.fits(demand, len(occupied) + count):
                raise ResourceError(f"STRICT_PACK: node {home} has {dict(room.total)} in all, not enough for "
                                    f"{len(occupied) + count} owners of {dict(demand)}")
            return [Target(node=home) for _ in range(count)]
        fitting = sorted((n for n in nodes if n.fits(demand, count)), key=lambda n: n.node_id)
        if not fitting:
            raise ResourceError(f"STRICT_PACK: no node has room for {count} owners of {dict(demand)} "
                                f"(nodes: {[dict(n.total) for n in nodes]})")
        return [Target(node=fitting[0].node_id) for _ in range(count)]
    free = sorted((n for n in nodes if n.node_id not in set(occupied) and n.fits(demand, 1)), key=lambda n: n.node_id)
    if len(free) < count:
        raise ResourceError(f"STRICT_SPREAD: {count} more owners need as many nodes without one, but "
                            f"{len(free)} are left (the run's owners occupy {len(set(occupied))} of {len(nodes)})")
    return [Target(node=n.node_id) for n in free[:count]]


def place_groups(strategy: str, *, ranks: Sequence[int], group_size: int, demand: Mapping[str, float],
                 nodes: Sequence[NodeRoom], occupied: Sequence[str]) -> list[Target]:
    """Targets for new owners ``ranks`` when every ``group_size`` consecutive ranks (a
    tensor-parallel group) share a node; ``occupied[r]``: the node of the run's current rank r
    (those not among ``ranks``). ``group_size`` 1 is ``place``."""
    if group_size == 1 or strategy == "STRICT_PACK":
        return place(strategy, count=len(ranks), demand=demand, nodes=nodes, occupied=occupied)
    if strategy not in ("PACK", "SPREAD"):
        raise ResourceError(f"placement_strategy={strategy!r} cannot keep tensor-parallel groups of {group_size} "
                            "owners on one node each; use 'PACK', 'SPREAD' or 'STRICT_PACK'")
    new = set(ranks)
    load = Counter(node for r, node in enumerate(occupied) if r not in new and node)
    rooms = {n.node_id: n for n in nodes}
    homes: dict[int, str] = {}
    for rank in ranks:
        group = rank // group_size
        if group in homes:
            continue
        members = range(group * group_size, (group + 1) * group_size)
        there = {occupied[r] for r in members if r < len(occupied) and r not in new and occupied[r]}
        need = sum(1 for r in members if r in new)
        if len(there) > 1:
            raise ResourceError(f"tensor-parallel group {group} (ranks {members.start}-{members.stop - 1}) is on "
                                f"several nodes already ({sorted(there)})")
        if there:
            home = there.pop()
            if home not in rooms or not rooms[home].fits(demand, load[home] + need):
                raise ResourceError(f"tensor-parallel group {group}'s node {home} is gone or has no room for "
                                    f"{need} more owners of {dict(demand)}; its owners must share one node")
        else:
            fitting = [n for n in nodes if n.fits(demand, load[n.node_id] + need)]
            if not fitting:
                raise ResourceError(f"no node has room for a tensor-parallel group of {need} owners of "
                                    f"{dict(demand)} (nodes: {[dict(n.total) for n in nodes]}, this run's owners "
                                    f"on them: {dict(load)}); a TP group's owners share one node")
            sign = -1 if strategy == "PACK" else 1
            home = min(fitting, key=lambda n: (sign * load[n.node_id], n.node_id)).node_id
        homes[group] = home
        load[home] += need
    return [Target(node=homes[r // group_size]) for r in ranks]


@dataclass(frozen=True, kw_only=True)
class GroupedSurvivors:
    """The owners that go on after a loss, in their new positions (``kept[p]`` is the old rank
    at position p), and those that leave."""

    kept: tuple[int, ...]
    leaving: tuple[int, ...]


def group_survivors(survivors: Sequence[int], nodes: Sequence[str], *, group_size: int,
                    target: int, copies: Mapping[int, Collection[int]] | None = None) -> GroupedSurvivors:
    """Which ``survivors`` (old ranks; ``nodes[r]``: old rank r's node) go on at ``target`` owners
    (a multiple of ``group_size``), and in which positions, so that every tensor-parallel group
    (``group_size`` consecutive positions) is on one node. The pool rebuilds with the kept
    survivors in this order and starts the new owners after them (``pool.rebuild``), so:

    - whole groups of survivors on one node come first, in rank order: intact old groups (their
      owners keep their TP ranks) and groups of one node's other survivors;
    - then at most one node's remainder, the one with the most survivors, as the last group
      (its missing members are the first new owners, which ``place_groups`` pins to its node);
    - every other survivor leaves: kept in order, two old groups' remainders would form a TP
      group straddling nodes.

    ``copies[r]``: the old ranks whose state survivor r holds (its own and its peer snapshots'
    wards). Where there is a choice (more whole groups than ``target`` takes, or several nodes'
    remainders), the groups holding copies no group already chosen holds go on first: sending
    away the only holder of a lost rank's copy would make the peer restore fall back to the
    checkpoint. Ties (and no ``copies``) go as above, by rank.

    ``group_size`` 1: the lowest ``target`` ranks, the rest leave (``ScalingPolicy.leavers``)."""
    ordered = sorted(survivors)
    if group_size == 1:
        return GroupedSurvivors(kept=tuple(ordered[:target]), leaving=tuple(ordered[target:]))
    if target % group_size:
        raise ResourceError(f"{target} owners are not whole tensor-parallel groups of {group_size}")
    on: dict[str, list[int]] = {}
    for r in ordered:
        on.setdefault(nodes[r], []).append(r)
    whole: list[list[int]] = []
    rest: list[list[int]] = []
    for members in on.values():
        # intact old groups first (their owners keep their TP ranks: no state moves between
        # shards), then the node's other survivors in groups of their own
        old = {r // group_size: [m for m in members if m // group_size == r // group_size] for r in members}
        intact = [g for g in old.values() if len(g) == group_size]
        others = [r for r in members if len(old[r // group_size]) < group_size]
        cut = len(others) - len(others) % group_size
        whole += intact + [others[i:i + group_size] for i in range(0, cut, group_size)]
        if cut < len(others):
            rest.append(others[cut:])
    groups = target // group_size
    held = {r: frozenset((copies or {}).get(r, ())) for r in ordered}
    covered: set[int] = set()

    def adds(group: list[int]) -> int:  # old ranks' copies this group alone would keep
        return len(set().union(*(held[r] for r in group)) - covered)

    chosen: list[list[int]] = []
    candidates = sorted(whole, key=lambda g: g[0])
    while candidates and len(chosen) < groups:  # greedy cover; by rank where nothing is added
        best = min(candidates, key=lambda g: (-adds(g), g[0]))
        candidates.remove(best)
        chosen.append(best)
        covered.update(*(held[r] for r in best))
    chosen.sort(key=lambda g: g[0])
    if len(chosen) < groups and rest:
        short = len(set().union(*held.values()) - covered)  # copies still to keep
        chosen.append(min(rest, key=lambda g: (adds(g) < short, -adds(g), -len(g), g[0])))
    kept = tuple(r for g in chosen for r in g)
    return GroupedSurvivors(kept=kept, leaving=tuple(r for r in ordered if r not in set(kept)))
