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
from dataclasses import dataclass

import torch

from zero_ray.collective.group import Collective
from zero_ray.core.layout import Bucket
from zero_ray.core.reshard import Move, bucket_range
from zero_ray.errors import CollectiveError
from zero_ray.owner.engine import OptimizerSlice


@dataclass(frozen=True, kw_only=True)
class StagedRange:
    """Where one bucket's new range lands before the new model state exists."""

    bucket: int
    start: int
    end: int
    tensors: dict[str, torch.Tensor]  # "master" and each moment, fp32, end - start elements


def stage_buffers(bucket_numels: list[int], *, rank: int, world_size: int, whole: bool,
                  kinds: tuple[str, ...]) -> list[StagedRange]:
    """Zeroed host buffers for every range ``rank`` will update in the new layout."""
    out = []
    for b, numel in enumerate(bucket_numels):
        lo, hi = bucket_range(numel, world_size, rank, whole=whole)
        out.append(StagedRange(bucket=b, start=lo, end=hi,
                               tensors={k: torch.zeros(hi - lo, dtype=torch.float32) for k in kinds}))
    return out


def _source_views(slices: list[OptimizerSlice]) -> dict[int, OptimizerSlice]:
    return {s.bucket.index: s for s in slices}


def exchange(moves: list[Move], *, me: int, old: list[OptimizerSlice] | None, staged: list[StagedRange] | None,
             kinds: tuple[str, ...], group: Collective | None, timeout_s: float) -> int:
    """Carry out this actor's part of ``moves``: local copies, sends from ``old`` slices, receives
    into ``staged`` ranges. Returns bytes sent to other actors."""
    import torch.distributed as dist

    src_of = _source_views(old or [])
    dst_of = {r.bucket: r for r in staged or []}
    ops: list[object] = []
    keep: list[torch.Tensor] = []  # send buffers must outlive the transfer
    sent = 0
    pg = getattr(group, "process_group", None)
    for i, m in enumerate(moves):
        if me not in (m.src, m.dst):
            continue
        for k, kind in enumerate(kinds):
            tag = i * len(kinds) + k
            if m.src == me:
                s = src_of[m.bucket]
                value = (s.master if kind == "master" else s.moments[kind])[m.start - s.start:m.end - s.start]
            if m.dst == me:
                r = dst_of[m.bucket]
                into = r.tensors[kind][m.start - r.start:m.end - r.start]
            if m.local:
                into.copy_(value)
            elif m.src == me:
                buf = value.detach().to("cpu", torch.float32).contiguous()
                keep.append(buf)
                ops.append(dist.P2POp(dist.isend, buf, m.dst, group=pg, tag=tag))
                sent += buf.numel() * 4
            else:
                ops.append(dist.P2POp(dist.irecv, into, m.src, group=pg, tag=tag))
    if ops:
        if pg is None:
            raise CollectiveError(f"rank {me} has transfers to make but no transfer group")
        try:
            for work in dist.batch_isend_irecv(ops):  # type: ignore[arg-type]
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise CollectiveError(f"resharding transfer on actor {me} failed: {err}") from err
    return sent


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
