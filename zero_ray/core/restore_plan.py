"""The plans a resize or a restore sends every owner, typed (pure).

The driver builds them, converts them to plain data once where it calls the owners
(``to_data``), and an owner's control handler converts them back once (``reshard_from_data``,
``restore_from_data``); nothing in between reads plans by string keys.

``TransferDescription`` is what every rank of a transfer needs besides the tensors (the layout,
the optimizer's state table, the counters the state continues from): each owner describes its
part (``OwnerEngine.transfer_description``), the driver merges them (``merged``), and it travels
inside the plan. ``SnapshotRecord`` is what an owner says of a peer snapshot it holds.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zero_ray.core.optim_state import StateEntry, merge_tables
from zero_ray.core.run_position import Position
from zero_ray.core.replica_plan import ReplicaPlan, ReplicaRound
from zero_ray.errors import ConfigError

_PEERS = "peers"


@dataclass(frozen=True, kw_only=True)
class RunCounters:
    """What moved or restored model state continues from besides its tensors (equal on every
    rank): the run's position, the loss scaler's, and the optimizers' hyperparameters and
    schedulers (``ShardOptimizer.hyper_state``: JSON data of its own)."""

    position: Position
    scale: float
    growth_tracker: int
    hyper: Mapping[str, Any]

    def to_data(self) -> dict[str, Any]:
        return {"position": self.position.to_data(), "scale": self.scale, "growth_tracker": self.growth_tracker,
                "hyper": dict(self.hyper)}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RunCounters:
        return cls(position=Position.from_data(data["position"]), scale=float(data["scale"]),
                   growth_tracker=int(data["growth_tracker"]), hyper=data["hyper"])


@dataclass(frozen=True, kw_only=True)
class TransferDescription:
    """What every rank of a transfer plans it from: the layout (``FlatLayout.describe``), the
    parameters stepped whole, whether the optimizer state is replicated, the optimizer state
    table (``core/optim_state.py``) and the counters."""

    layout: Mapping[str, list]
    whole_params: tuple[int, ...]
    replicated: bool
    table: Mapping[int, StateEntry]
    counters: RunCounters

    @classmethod
    def merged(cls, parts: Sequence[TransferDescription]) -> TransferDescription:
        """One description from every rank's: each knows the table entries of what it updates."""
        if not parts:
            raise ConfigError("a transfer description merged from no owner's part")
        return replace(parts[0], table=merge_tables(p.table for p in parts))

    def to_data(self) -> dict[str, Any]:
        return {"layout": dict(self.layout), "whole_params": list(self.whole_params), "replicated": self.replicated,
                "table": {int(k): dict(v) for k, v in self.table.items()}, "counters": self.counters.to_data()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> TransferDescription:
        return cls(layout=data["layout"], whole_params=tuple(int(p) for p in data["whole_params"]),
                   replicated=bool(data["replicated"]), table=merge_tables([data["table"]]),
                   counters=RunCounters.from_data(data["counters"]))


@dataclass(frozen=True, kw_only=True)
class SnapshotRecord:
    """A committed peer snapshot an owner holds: of ``step`` (index of the step it followed),
    in a ``world_size``-rank layout, and the description a restore from it plans with."""

    step: int
    world_size: int
    description: TransferDescription

    def to_data(self) -> dict[str, Any]:
        return {"step": self.step, "world_size": self.world_size, "description": self.description.to_data()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> SnapshotRecord:
        return cls(step=int(data["step"]), world_size=int(data["world_size"]),
                   description=TransferDescription.from_data(data["description"]))


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

    description: TransferDescription
    peers: Peers | None = None

    def to_data(self) -> dict[str, Any]:
        peers = {_PEERS: self.peers.to_data()} if self.peers else {}
        return {"description": self.description.to_data(), **peers}


@dataclass(frozen=True, kw_only=True)
class PeerRestore:
    """A restore from peer snapshots: ``holders[i]`` is the rebuilt pool's rank holding old rank
    i's snapshot; ``old_world`` the layout the snapshots were taken in."""

    old_world: int
    holders: tuple[int, ...]
    description: TransferDescription
    peers: Peers | None = None

    def __post_init__(self) -> None:
        if len(self.holders) != self.old_world:
            raise ConfigError(f"a peer restore of {self.old_world} old ranks names {len(self.holders)} holders")


@dataclass(frozen=True, kw_only=True)
class ReplicaRestore:
    """A restore from a surviving shard group's live state (``core/replica_plan.py``)."""

    plan: ReplicaPlan
    description: TransferDescription
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
                "description": plan.description.to_data(), **peers}
    return {"kind": "peer", "old_world": plan.old_world, "holders": list(plan.holders),
            "description": plan.description.to_data(), **peers}


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
        return ReplicaRestore(plan=plan, description=TransferDescription.from_data(data["description"]), peers=peers)
    if kind == "peer":
        return PeerRestore(old_world=int(data["old_world"]), holders=tuple(data["holders"]),
                           description=TransferDescription.from_data(data["description"]), peers=peers)
    raise ConfigError(f"a restore plan of kind {kind!r}; expected 'peer' or 'replica'")


def reshard_from_data(data: Mapping[str, Any]) -> ReshardPlan:
    """The typed plan from a Reshard call's plain data."""
    return ReshardPlan(description=TransferDescription.from_data(data["description"]),
                       peers=Peers.from_data(data.get(_PEERS)))
