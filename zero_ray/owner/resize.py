"""Live resharding on one actor: move optimizer slices between the old layout (N ranks) and
the new one (M ranks) by point-to-point transfers over a group of every actor involved.

Only one torch.distributed group can live in a process at a time (ray.util.collective's gloo
groups ride on the default process group, whose size is fixed), so the sequence is: leave the
old group; join a transfer group of max(N, M) actors (actor i is old rank i and new rank i);
send the pieces ``core.reshard.plan_moves`` assigns to this actor and receive its new ranges
into host staging buffers; then (shrinking) leave it and join the M-rank group; build the new
model state and copy the staged ranges in. A rank sends only ranges whose owner changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.collective.group import Collective
from zero_ray.core.layout import Bucket
from zero_ray.core.reshard import Move, bucket_range
from zero_ray.errors import CollectiveError
from zero_ray.owner.param_group import OptimizerSlice


@dataclass(frozen=True, kw_only=True)
class StagedRange:
    """Where one bucket's new range lands before the new model state exists."""

    bucket: int
    start: int
    end: int
    tensors: dict[str, torch.Tensor]  # "master" and each moment, fp32, end - start elements

Kinds = Sequence[Sequence[str]]  # per bucket: "master" and, for trainable buckets, each moment


def slice_kinds(slices: Sequence[OptimizerSlice]) -> list[list[str]]:
    """What each bucket's slice holds: the master values and its moments (none when frozen)."""
    return [["master", *s.moments] for s in slices]


def stage_buffers(bucket_numels: list[int], *, rank: int, world_size: int, whole: bool,
                  kinds: Kinds) -> list[StagedRange]:
    """Zeroed host buffers for every range ``rank`` will update in the new layout."""
    out = []
    for b, numel in enumerate(bucket_numels):
        lo, hi = bucket_range(numel, world_size, rank, whole=whole)
        out.append(StagedRange(bucket=b, start=lo, end=hi,
                               tensors={k: torch.zeros(hi - lo, dtype=torch.float32) for k in kinds[b]}))
    return out


def exchange(moves: list[Move], *, me: int, sources: dict[int, list[OptimizerSlice]], senders: list[int],
             staged: list[StagedRange] | None, kinds: Kinds, group: Collective | None,
             timeout_s: float) -> int:
    """Carry out this actor's part of ``moves``. ``moves`` name old ranks as sources;
    ``senders[i]`` is the position of the actor holding old rank i's state (itself for a live
    resize; a peer's copy after a loss) and ``sources`` the slices this actor holds, by old rank.
    ``kinds[b]`` are the tensors bucket ``b`` holds. Local pieces are copied, others sent or
    received into ``staged``. Returns bytes sent."""
    import torch.distributed as dist

    src_of = {rank: {s.bucket.index: s for s in slices} for rank, slices in sources.items()}
    dst_of = {r.bucket: r for r in staged or []}
    ops: list[object] = []
    keep: list[torch.Tensor] = []  # send buffers must outlive the transfer
    sent = 0
    pg = getattr(group, "process_group", None)
    width = max((len(k) for k in kinds), default=1)
    for i, m in enumerate(moves):
        sender = senders[m.src]
        if me not in (sender, m.dst):
            continue
        for k, kind in enumerate(kinds[m.bucket]):
            tag = i * width + k
            if sender == me:
                s = src_of[m.src][m.bucket]
                value = (s.master if kind == "master" else s.moments[kind])[m.start - s.start:m.end - s.start]
            if m.dst == me:
                r = dst_of[m.bucket]
                into = r.tensors[kind][m.start - r.start:m.end - r.start]
            if sender == m.dst:
                into.copy_(value)
            elif sender == me:
                buf = value.detach().to("cpu", torch.float32).contiguous()
                keep.append(buf)
                ops.append(dist.P2POp(dist.isend, buf, m.dst, group=pg, tag=tag))
                sent += buf.numel() * 4
            else:
                ops.append(dist.P2POp(dist.irecv, into, sender, group=pg, tag=tag))
    run_p2p(ops, me=me, pg=pg, timeout_s=timeout_s, what="resharding transfer")
    return sent


def run_p2p(ops: list[object], *, me: int, pg: object, timeout_s: float, what: str) -> None:
    """Post ``ops`` (torch P2POps) together and wait for all of them, each wait bounded."""
    import torch.distributed as dist

    if not ops:
        return
    if pg is None:
        raise CollectiveError(f"actor {me} has {what} messages to exchange but no group")
    # Pending works keep the group's sockets open; dropped on the way out, even on an error (whose
    # traceback keeps this frame), so that an abort closes the group for the peers.
    works: list[Any] = []
    try:
        works += dist.batch_isend_irecv(ops)  # type: ignore[arg-type]
        while works:
            works[0].wait(timeout=datetime.timedelta(seconds=timeout_s))
            works.pop(0)
    except RuntimeError as err:
        raise CollectiveError(f"{what} on actor {me} failed: {err}") from err
    finally:
        works.clear()


def install(staged: list[StagedRange], new: list[OptimizerSlice]) -> None:
    """Copy the staged ranges into the new model state's slices (same buckets and ranges)."""
    by_bucket = {r.bucket: r for r in staged}
    with torch.no_grad():
        for s in new:
            r = by_bucket[s.bucket.index]
            if (r.start, r.end) != (s.start, s.end):
                raise CollectiveError(f"bucket {s.bucket.index}: staged range [{r.start}, {r.end}) differs from the "
                                      f"new layout's [{s.start}, {s.end})")
            s.master.copy_(r.tensors["master"])
            for kind, t in s.moments.items():
                t.copy_(r.tensors[kind])


def bucket_numels(buckets: tuple[Bucket, ...]) -> list[int]:
    return [b.numel for b in buckets]
