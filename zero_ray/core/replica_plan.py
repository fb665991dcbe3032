"""Restoring lost owners from another shard group's replica (pure).

With shard groups (``Topology(shard_group_size=G)``, R = N / G groups) every group holds the
whole model state, partitioned over its G members, and replicas end every step with identical
bits. So when owners are lost and at least one whole group survives, the lost state is still
live: every rank of the rebuilt pool takes the state of its group rank from the member of the
surviving group with that group rank. Nothing is read from storage and no peer snapshot is
needed; the restored state is at the step the survivors completed.

``replica_plan`` turns the old mesh, the lost ranks, the survivors (kept in order: survivor i
becomes rank i of the rebuilt pool) and the rebuilt pool's mesh into transfer rounds: one per
new shard group, from the surviving group's members (senders, by group rank) to the new group's
(receivers, by group rank), each a flat G -> G transfer (a local copy where sender is receiver).

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from zero_ray.core.topology import Mesh
from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ReplicaRound:
    """A G -> G transfer: ``senders[i]`` (a rank of the rebuilt pool) sends group rank i's
    state; ``receivers[j]`` (a rank of the rebuilt pool) takes group rank j's."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    source: tuple[int, ...]  # old world ranks of the surviving group, by group rank
    group_size: int
    rounds: tuple[ReplicaRound, ...]


def surviving_group(mesh: Mesh, lost: Set[int]) -> tuple[int, ...] | None:
    """World ranks (by group rank) of the first shard group none of whose members was lost;
    None when every group lost a member (with one group, a loss leaves no replica)."""
    for start in range(0, mesh.world_size, mesh.shard):
        members = mesh.order[start:start + mesh.shard]
        if not set(members) & set(lost):
            return tuple(members)
    return None


def replica_plan(old: Mesh, *, lost: Set[int], survivors: Sequence[int], new: Mesh) -> ReplicaPlan:
    """The transfer that restores the rebuilt pool (``new``) from a surviving group of ``old``."""
    source = surviving_group(old, lost)
    if source is None:
        raise ConfigError(f"no shard group of {old.shard} survives the loss of ranks {sorted(lost)}: "
                          "there is no replica to restore from")
    if new.shard != old.shard:
        raise ConfigError(f"the rebuilt pool's shard groups have {new.shard} owners, the lost pool's {old.shard}; "
                          "a replica restore keeps the group size")
    at = {old_rank: rank for rank, old_rank in enumerate(survivors)}
    missing = [r for r in source if r not in at]
    if missing:
        raise ConfigError(f"the surviving group {list(source)} must be kept whole, but ranks {missing} leave")
    senders = tuple(at[r] for r in source)
    rounds = tuple(ReplicaRound(senders=senders, receivers=tuple(new.order[k:k + new.shard]))
                   for k in range(0, new.world_size, new.shard))
    return ReplicaPlan(source=source, group_size=old.shard, rounds=rounds)


def keep_whole_groups(survivors: Sequence[int], source: Sequence[int], size: int) -> list[int]:
    """The survivors that stay when only ``size`` owners of the rebuilt pool can be survivors:
    the surviving group first (it must stay), then the others in order; the order of the
    survivors kept is their old order."""
    keep = set(source)
    for r in survivors:
        if len(keep) >= size:
            break
        keep.add(r)
    return [r for r in survivors if r in keep]
