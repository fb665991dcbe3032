"""Live resharding on one actor: move optimizer state between the old layout (N ranks) and the
new one (M ranks) by point-to-point transfers over a group of every actor involved.

Only one torch.distributed group can live in a process at a time (ray.util.collective's gloo
groups ride on the default process group, whose size is fixed), so the sequence is: leave the
old group; join a transfer group of max(N, M) actors (actor i is old rank i and new rank i);
send the pieces ``core.reshard_plan.plan_moves`` assigns to this actor and receive its new ranges
into host staging buffers; then (shrinking) leave it and join the M-rank group; build the new
model state and copy the staged ranges in. A rank sends only ranges whose owner changes.

What moves: per bucket range the master weights and the element-wise optimizer state by name
(``bucket_kinds``: the names any parameter of the bucket has); per whole-tensor parameter its
state, from the old layout's assignee to the new one's (``plan_whole_moves``); and the merged
``StateTable`` (scalars such as step counts), which travels in the transfer's description.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_ray.collective.collective_api import Collective
from zero_ray.core.whole_tensor_assignees import plan_whole_tensors
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.optim_state import StateTable, bucket_kinds
from zero_ray.core.reshard_plan import Move, WholeMove, bucket_range, plan_moves, plan_whole_moves
from zero_ray.core.restore_plan import TransferDescription
from zero_ray.errors import CollectiveError
from zero_ray.owner.step.model_state import ModelState
from zero_ray.owner.step.param_group import OptimizerSlice

WholeState = dict[int, dict[str, torch.Tensor]]  # parameter -> whole-tensor state by name


@dataclass(frozen=True, kw_only=True)
class StagedRange:
    """Where one bucket's new range lands before the new model state exists."""

    bucket: int
    start: int
    end: int
    tensors: dict[str, torch.Tensor]  # "master" and each element-wise state, fp32, end - start elements


@dataclass(kw_only=True)
class RankState:
    """One old rank's state in transit: its optimizer slices and the whole-tensor state of the
    parameters it was the assignee of."""

    slices: list[OptimizerSlice]
    whole: WholeState = field(default_factory=dict)


@dataclass(kw_only=True)
class Staged:
    """What this actor receives for its new rank."""

    ranges: list[StagedRange]
    whole: WholeState


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """A transfer from ``old_world`` to ``new_world`` ranks, as every actor computes it."""

    moves: list[Move]
    kinds: list[list[str]]
    whole_moves: list[WholeMove]
    table: dict[int, Any]
    buckets: list[int]
    replicated: bool

    @classmethod
    def of(cls, info: TransferDescription, *, old_world: int, new_world: int) -> TransferPlan:
        table = dict(info.table)
        old = FlatLayout.from_description(dict(info.layout), world_size=old_world)
        new = FlatLayout.from_description(dict(info.layout), world_size=new_world)
        whole = list(info.whole_params)
        replicated = info.replicated
        numels = [b.numel for b in old.buckets]
        return cls(moves=plan_moves(numels, old_world=old_world, new_world=new_world, whole=replicated),
                   kinds=bucket_kinds(old, table), table=table, buckets=numels, replicated=replicated,
                   whole_moves=plan_whole_moves(table, old_assignee=plan_whole_tensors(old, whole).assignee,
                                                new_assignee=plan_whole_tensors(new, whole).assignee,
                                                new_world=new_world, replicated=replicated))

    def staging(self, rank: int, world_size: int) -> Staged:
        """Zeroed host buffers for everything ``rank`` receives in the new layout."""
        ranges = []
        for b, numel in enumerate(self.buckets):
            lo, hi = bucket_range(numel, world_size, rank, whole=self.replicated)
            ranges.append(StagedRange(bucket=b, start=lo, end=hi,
                                      tensors={k: torch.zeros(hi - lo, dtype=torch.float32) for k in self.kinds[b]}))
        whole: WholeState = {}
        for m in self.whole_moves:
            if m.dst == rank:
                whole.setdefault(m.param, {})[m.key] = torch.zeros(m.shape, dtype=getattr(torch, m.dtype))
        return Staged(ranges=ranges, whole=whole)


def exchange(plan: TransferPlan, *, me: int, sources: dict[int, RankState], senders: Sequence[int],
             staged: Staged | None, group: Collective | None, timeout_s: float,
             receivers: Sequence[int] | None = None) -> int:
    """Carry out this actor's part of ``plan``. Moves name old ranks as sources; ``senders[i]``
    is the position of the actor holding old rank i's state (itself for a live resize; a peer's
    copy after a loss) and ``sources`` the state this actor holds, by old rank; ``receivers[j]``
    the position taking new rank j (default: position j; a shard group's replica restore maps
    group ranks to world positions). Local pieces are copied, others sent or received into
    ``staged``. Returns bytes sent."""
    import torch.distributed as dist

    src_of = {rank: {s.bucket.index: s for s in state.slices} for rank, state in sources.items()}
    dst_of = {r.bucket: r for r in (staged.ranges if staged is not None else [])}
    ops: list[object] = []
    keep: list[torch.Tensor] = []  # send buffers must outlive the transfer
    sent = 0
    pg = getattr(group, "process_group", None)
    width = max((len(k) for k in plan.kinds), default=1)
    at = (lambda j: j) if receivers is None else (lambda j: receivers[j])

    def pair(sender: int, dst: int, tag: int, value: torch.Tensor | None, into: torch.Tensor | None) -> None:
        nonlocal sent
        if sender == dst:
            assert into is not None and value is not None
            into.copy_(value)
        elif sender == me:
            assert value is not None
            buf = value.detach().to("cpu").contiguous()
            keep.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, dst, group=pg, tag=tag))
            sent += buf.numel() * buf.element_size()
        else:
            ops.append(dist.P2POp(dist.irecv, into, sender, group=pg, tag=tag))

    for i, m in enumerate(plan.moves):
        sender, dst = senders[m.src], at(m.dst)
        if me not in (sender, dst):
            continue
        for k, kind in enumerate(plan.kinds[m.bucket]):
            value = into = None
            if sender == me:
                s = src_of[m.src][m.bucket]
                held = s.master if kind == "master" else s.moments.get(kind)
                # A rank that never stepped a parameter of this bucket has no such state: zeros.
                value = (held[m.start - s.start:m.end - s.start] if held is not None
                         else torch.zeros(m.end - m.start, dtype=torch.float32))
                value = value.float()
            if dst == me:
                assert staged is not None
                r = dst_of[m.bucket]
                into = r.tensors[kind][m.start - r.start:m.end - r.start]
            pair(sender, dst, i * width + k, value, into)
    base = len(plan.moves) * width
    for j, w in enumerate(plan.whole_moves):
        sender, dst = senders[w.src], at(w.dst)
        if me not in (sender, dst):
            continue
        value = sources[w.src].whole[w.param][w.key] if sender == me else None
        into = staged.whole[w.param][w.key] if (dst == me and staged is not None) else None
        pair(sender, dst, base + j, value, into)
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


def install(staged: Staged, state: ModelState, table: StateTable) -> None:
    """Copy the staged ranges into a new model state (same buckets and ranges) and give its
    optimizer the state ``table`` describes."""
    by_bucket = {r.bucket: r for r in staged.ranges}
    optimizer = state.optimizer
    with torch.no_grad():
        optimizer.reset()
        for g in state.groups:
            r = by_bucket[g.index]
            if (r.start, r.end) != (g.update_start, g.update_end):
                raise CollectiveError(f"bucket {g.index}: staged range [{r.start}, {r.end}) differs from the new "
                                      f"layout's [{g.update_start}, {g.update_end})")
            g.master.copy_(r.tensors["master"])
            for kind, t in r.tensors.items():
                if kind != "master" and g.policy.trainable:
                    g.moment(kind).copy_(t)
    optimizer.load(table, staged.whole)
