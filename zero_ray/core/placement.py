"""Where new owners go, by the run's placement strategy (pure).

Owners are plain Ray actors that ask for their slot (one GPU, or ``num_cpus_per_owner`` CPUs)
themselves: a slot is held exactly as long as its owner lives, so a lost or removed owner gives
it back at once and a replacement can take it (a placement group would keep a dead owner's
bundle reserved until the whole group is removed). The strategies keep their placement-group
meaning across owners: PACK and SPREAD are Ray's own scheduling (best effort); STRICT_PACK puts
every owner on one node, STRICT_SPREAD every owner on a node of its own, pinned by node.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
