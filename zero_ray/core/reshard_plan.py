"""Reshard plan: which ranges move between which ranks when the world size changes live.

Buckets do not depend on the world size (only their padding does), so a bucket is the same
flat sequence of parameters before and after; only the shard boundaries move. Every old rank
holds at least its own shard range of every bucket, so each range a new rank will update is
cut along the old shard boundaries and each piece taken from the old rank that owned it: a
rank sends only the ranges whose owner changes (a piece whose old and new owner are the same
actor is copied locally). With a replicated optimizer (stage 0) new ranks update whole buckets,
so they receive every piece, spread over all old ranks.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Move:
    """Elements ``[start, end)`` of ``bucket`` (bucket coordinates) from old rank ``src`` to new
    rank ``dst``. Ranks are actor positions: old rank i and new rank i are the same actor."""

    bucket: int
    start: int
    end: int
    src: int
    dst: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def local(self) -> bool:
        return self.src == self.dst


def bucket_range(bucket_numel: int, world_size: int, rank: int, *, whole: bool) -> tuple[int, int]:
    """The ``[start, end)`` a rank updates: its shard of the padded bucket, or all of it."""
    padded = max(world_size, -(-bucket_numel // world_size) * world_size)
    if whole:
        return 0, padded
    shard = padded // world_size
    return rank * shard, (rank + 1) * shard


def plan_moves(bucket_numels: Sequence[int], *, old_world: int, new_world: int, whole: bool) -> list[Move]:
    """Every piece each new rank needs (only real elements: padding is zeros on both sides),
    in a deterministic order that every rank computes identically."""
    if old_world < 1 or new_world < 1:
        raise ConfigError(f"{old_world=} and {new_world=} must both be at least 1")
    moves: list[Move] = []
    for index, numel in enumerate(bucket_numels):
        old_shard = bucket_range(numel, old_world, 0, whole=False)[1]
        for dst in range(new_world):
            lo, hi = bucket_range(numel, new_world, dst, whole=whole)
            hi = min(hi, numel)
            pos = lo
            while pos < hi:
                src = pos // old_shard
                end = min(hi, (src + 1) * old_shard)
                moves.append(Move(bucket=index, start=pos, end=end, src=src, dst=dst))
                pos = end
    return moves


@dataclass(frozen=True, kw_only=True)
class WholeMove:
    """Whole-tensor optimizer state ``key`` of parameter ``param`` (``shape``, ``dtype``) from
    old rank ``src`` (its assignee) to new rank ``dst``."""

    param: int
    key: str
    shape: tuple[int, ...]
    dtype: str
    src: int
    dst: int


def plan_whole_moves(table: Mapping[int, Mapping[str, Any]], *, old_assignee: Mapping[int, int],
                     new_assignee: Mapping[int, int], new_world: int, replicated: bool) -> list[WholeMove]:
    """Every whole-tensor state tensor's move from the old layout's assignee of its parameter
    to the new one's (to every new rank where the optimizer is replicated), in an order every
    rank computes identically."""
    moves = []
    for param in sorted(table):
        for key, desc in sorted(table[param].get("whole", {}).items()):
            dsts = range(new_world) if replicated else [new_assignee[param]]
            moves += [WholeMove(param=param, key=key, shape=tuple(desc["shape"]), dtype=desc["dtype"],
                                src=old_assignee[param], dst=d) for d in dsts]
    return moves


def bytes_moved(moves: list[Move], *, element_bytes: int) -> dict[int, int]:
    """Bytes each old rank sends to other actors (local copies excluded), per moved tensor."""
    out: dict[int, int] = {}
    for m in moves:
        if not m.local:
            out[m.src] = out.get(m.src, 0) + m.numel * element_bytes
    return out


def backup_peers(nodes: Sequence[str]) -> list[int]:
    """For in-memory redundancy: the rank that keeps a copy of each rank's shard (a bijection, so
    every rank keeps exactly one peer's). Ranks are ordered by node and each backed up by the rank
    ``g`` places further on (``g`` the largest number of ranks on one node), which lands on
    another node whenever the cluster has more than one; with one rank, itself."""
    n = len(nodes)
    order = sorted(range(n), key=lambda r: (nodes[r], r))
    most = max((sum(1 for x in nodes if x == node) for node in set(nodes)), default=1)
    shift = most if most < n else 1
    backup = [0] * n
    for pos, rank in enumerate(order):
        backup[rank] = order[(pos + shift) % n] if n > 1 else rank
    return backup
