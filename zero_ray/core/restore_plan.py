"""The plans a resize or a restore sends every owner, typed (pure).

The driver builds them, converts them to plain data once where it calls the owners
(``to_data``), and an owner's control handler converts them back once (``reshard_from_data``,
``restore_from_data``); nothing in between reads plans by string keys.

``description`` is the merged transfer description every rank of a transfer needs (the old
layout, the optimizer's state table, the counters the state continues from): owners build their
parts (``owner/resize.describe_state``) and the driver merges them; it travels as it is.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zero_ray.core.replica import ReplicaPlan, ReplicaRound
from zero_ray.errors import ConfigError

_PEERS = "peers"


@dataclass(frozen=True, kw_only=True)
class Peers:
    """Which peer keeps each rank's snapshots (``backup[r]``) and whose each keeps (``ward[r]``)."""

    backup: tuple[int, ...]
    ward: tuple[int, ...]

    @classmethod
    def of(cls, backup: Sequence[int]) -> Peers:
        ward = [0] * len(backup)
        for r, b in enumerate(backup):
            ward[b] = r
        return cls(backup=tuple(backup), ward=tuple(ward))

    @classmethod
    def own(cls, count: int) -> Peers:
        """Every rank its own backup (no peer redundancy: SetPeers still confirms the layout)."""
        return cls(backup=tuple(range(count)), ward=tuple(range(count)))

    def to_data(self) -> dict[str, list[int]]:
        return {"backup": list(self.backup), "ward": list(self.ward)}

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> Peers | None:
        return None if data is None else cls(backup=tuple(data["backup"]), ward=tuple(data["ward"]))


@dataclass(frozen=True, kw_only=True)
class ReshardPlan:
    """A resize: the merged description, and the new layout's peers (copies made inside it)."""

    description: Mapping[str, Any]
    peers: Peers | None = None

    def to_data(self) -> dict[str, Any]:
        return {**self.description, _PEERS: self.peers.to_data()} if self.peers else dict(self.description)


@dataclass(frozen=True, kw_only=True)
class PeerRestore:
    """A restore from peer snapshots: ``holders[i]`` is the rebuilt pool's rank holding old rank
    i's snapshot; ``old_world`` the layout the snapshots were taken in."""

    old_world: int
    holders: tuple[int, ...]
    description: Mapping[str, Any]
    peers: Peers | None = None

    def __post_init__(self) -> None:
        if len(self.holders) != self.old_world:
            raise ConfigError(f"a peer restore of {self.old_world} old ranks names {len(self.holders)} holders")


@dataclass(frozen=True, kw_only=True)
class ReplicaRestore:
    """A restore from a surviving shard group's live state (``core/replica.py``)."""

    plan: ReplicaPlan
    description: Mapping[str, Any]
    peers: Peers | None = None


RestorePlan = PeerRestore | ReplicaRestore


def restore_to_data(plan: RestorePlan | None) -> dict[str, Any] | None:
    """The plain data a Rebuild call carries."""
    if plan is None:
        return None
    peers = {_PEERS: plan.peers.to_data()} if plan.peers else {}
    if isinstance(plan, ReplicaRestore):
        return {"kind": "replica", "group_size": plan.plan.group_size, "source": list(plan.plan.source),
                "rounds": [{"senders": list(r.senders), "receivers": list(r.receivers)} for r in plan.plan.rounds],
                "description": dict(plan.description), **peers}
    return {"kind": "peer", "old_world": plan.old_world, "holders": list(plan.holders),
            "description": dict(plan.description), **peers}


def restore_from_data(data: Mapping[str, Any] | None) -> RestorePlan | None:
    """The typed plan from a Rebuild call's plain data (None: fresh state, a checkpoint next)."""
    if data is None:
        return None
    peers = Peers.from_data(data.get(_PEERS))
    kind = data.get("kind")
    if kind == "replica":
        rounds = tuple(ReplicaRound(senders=tuple(r["senders"]), receivers=tuple(r["receivers"]))
                       for r in data["rounds"])
        plan = ReplicaPlan(source=tuple(data["source"]), group_size=int(data["group_size"]), rounds=rounds)
        return ReplicaRestore(plan=plan, description=data["description"], peers=peers)
    if kind == "peer":
        return PeerRestore(old_world=int(data["old_world"]), holders=tuple(data["holders"]),
                           description=data["description"], peers=peers)
    raise ConfigError(f"a restore plan of kind {kind!r}; expected 'peer' or 'replica'")


def reshard_from_data(data: Mapping[str, Any]) -> ReshardPlan:
    """The typed plan from a Reshard call's plain data."""
    description = {k: v for k, v in data.items() if k != _PEERS}
    return ReshardPlan(description=description, peers=Peers.from_data(data.get(_PEERS)))
