"""Reshard plan: which ranges move between which ranks when the world size changes live.

Buckets do not depend on the world size (only their padding does), so a bucket is the same
flat sequence of parameters before and after; only the shard boundaries move. Every old rank
holds at least its own shard range of every bucket, so each range a new rank will update is
cut along the old shard boundaries and each piece taken from the old rank that owned it: a
rank sends only the ranges whose owner changes (a piece whose old and new owner are the same
actor is copied locally). With a replicated optimizer (stage 0) new ranks update whole buckets,
so they receive every piece, spread over all old ranks.

Across tensor-parallel sizes (a checkpoint saved at T resumed at T') a rank holds a ``Block`` of
each sharded parameter: its offsets and extent in every dimension of the whole tensor. A flat
range of one block is a list of ``runs`` contiguous in the whole tensor's row-major order, so what
a new rank's range needs from a saved one is the intersection of two sorted run lists
(``overlaps``), each piece contiguous on both sides.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import math
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


def backup_peers(nodes: Sequence[str], *, tensor_parallel: int = 1) -> list[int]:
    """For in-memory redundancy: the rank that keeps a copy of each rank's shard (a bijection, so
    every rank keeps exactly one peer's). Ranks are ordered by node and each backed up by the rank
    ``g`` places further on (``g`` the largest number of ranks on one node), which lands on
    another node whenever the cluster has more than one; with one rank, itself.

    With ``tensor_parallel`` T > 1 the pairing is made within each TP shard's data-parallel
    owners (ranks ``t, t + T, ...``, ``core/tensor_parallel_ranks.py``): only they hold the same
    shard's layout, so only they can keep, and later restore, each other's state. At D = 1 every
    rank is its own backup (nothing to restore from: the checkpoint is the source)."""
    n = len(nodes)
    if tensor_parallel < 1 or n % tensor_parallel:
        raise ConfigError(f"{n} ranks are not whole tensor_parallel groups of {tensor_parallel}")
    if tensor_parallel > 1:
        backup = [0] * n
        for t in range(tensor_parallel):
            members = list(range(t, n, tensor_parallel))
            for i, b in enumerate(backup_peers([nodes[r] for r in members])):
                backup[members[i]] = members[b]
        return backup
    order = sorted(range(n), key=lambda r: (nodes[r], r))
    most = max((sum(1 for x in nodes if x == node) for node in set(nodes)), default=1)
    shift = most if most < n else 1
    backup = [0] * n
    for pos, rank in enumerate(order):
        backup[rank] = order[(pos + shift) % n] if n > 1 else rank
    return backup


@dataclass(frozen=True, kw_only=True)
class Block:
    """The part of a tensor of shape ``full`` one rank holds: ``offsets`` and ``extent`` in every
    dimension (a TP shard: the whole tensor but along its sharded dimension). ``Block.whole``
    gives the tensor itself."""

    full: tuple[int, ...]
    offsets: tuple[int, ...]
    extent: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.full) == len(self.offsets) == len(self.extent):
            raise ConfigError(f"a block needs one offset and extent per dimension of {self.full}: "
                              f"offsets={self.offsets}, extent={self.extent}")
        for dim, (n, o, e) in enumerate(zip(self.full, self.offsets, self.extent)):
            if o < 0 or e < 0 or o + e > n:
                raise ConfigError(f"block offsets={self.offsets}, extent={self.extent} leave the tensor of shape "
                                  f"{self.full} in dimension {dim}")

    @classmethod
    def whole(cls, full: Sequence[int]) -> Block:
        return cls(full=tuple(full), offsets=(0,) * len(full), extent=tuple(full))

    @property
    def is_whole(self) -> bool:
        return self.extent == self.full

    @property
    def numel(self) -> int:
        return math.prod(self.extent)


def runs(block: Block, start: int, end: int) -> list[tuple[int, int, int]]:
    """Elements ``[start, end)`` of ``block``'s row-major flattening as ``(block position, whole
    position, length)`` runs, each contiguous in both, in increasing order of both."""
    if not 0 <= start <= end <= block.numel:
        raise ConfigError(f"elements [{start}, {end}) are outside a block of {block.numel}")
    if start == end:
        return []
    partial = [d for d, (n, e) in enumerate(zip(block.full, block.extent)) if n != e]
    if not partial:
        return [(start, start, end - start)]
    k = partial[-1]  # dimensions after k are whole: a run is one index of dims < k, all of dims >= k
    inner = math.prod(block.full[k + 1:])
    length = block.extent[k] * inner
    strides = [math.prod(block.full[d + 1:]) for d in range(k)]
    out = []
    for q in range(start // length, (end - 1) // length + 1):
        lo, hi = max(start, q * length), min(end, (q + 1) * length)
        whole, rest = block.offsets[k] * inner, q
        for d in reversed(range(k)):
            rest, i = divmod(rest, block.extent[d])
            whole += (block.offsets[d] + i) * strides[d]
        out.append((lo, whole + lo - q * length, hi - lo))
    return out


def span(block: Block, start: int, end: int) -> tuple[int, int]:
    """The whole tensor's positions ``[lo, hi)`` that elements ``[start, end)`` of ``block`` lie
    between (a cheap test before ``runs``: blocks whose spans miss share nothing)."""
    if start >= end:
        return 0, 0
    first, last = runs(block, start, start + 1)[0], runs(block, end - 1, end)[0]
    return first[1], last[1] + 1


def intersect(want: list[tuple[int, int, int]], want_start: int, have: list[tuple[int, int, int]],
              have_start: int) -> list[tuple[int, int, int]]:
    """``overlaps`` of two run lists (``runs``' output) of ranges starting at ``want_start`` and
    ``have_start``: ``(dest, src, length)`` by dest, adjacent pieces merged."""
    out: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(want) and j < len(have):
        (wa, fa, na), (wb, fb, nb) = want[i], have[j]
        lo, hi = max(fa, fb), min(fa + na, fb + nb)
        if lo < hi:
            dest, src = wa + lo - fa - want_start, wb + lo - fb - have_start
            if out and out[-1][0] + out[-1][2] == dest and out[-1][1] + out[-1][2] == src:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + hi - lo)  # contiguous on both sides: one piece
            else:
                out.append((dest, src, hi - lo))
        if fa + na <= fb + nb:
            i += 1
        else:
            j += 1
    return out  # both lists rise in whole position, and so in dest


def overlaps(want: Block, want_range: tuple[int, int], have: Block,
             have_range: tuple[int, int]) -> list[tuple[int, int, int]]:
    """What elements ``want_range`` of block ``want`` share with elements ``have_range`` of block
    ``have`` (both of one tensor): ``(dest, src, length)``, dest counted from ``want_range``'s
    start and src from ``have_range``'s, each piece contiguous on both sides, by dest."""
    if want.full != have.full:
        raise ConfigError(f"blocks of tensors of shapes {want.full} and {have.full} do not overlap")
    return intersect(runs(want, *want_range), want_range[0], runs(have, *have_range), have_range[0])
