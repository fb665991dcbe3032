"""Peer snapshots: every owner keeps, in host memory, a copy of its own shard and of one
peer's (its "ward"), so a lost owner's partition can be rebuilt without storage.

A snapshot is taken at the end of a step (after the update) into *pending* buffers: the own
copy is a local clone, the ward's arrives by point-to-point from the ward while this rank sends
its own to its backup. Pending becomes current only once the driver has seen every rank finish
that step (it says so by sending the next step, or ``commit_upto`` during recovery), so a
failure in the middle of an exchange leaves every rank's current copies at one common step.
With the optimizer state offloaded (``Offload(optimizer="nvme")``) the copies' slices are files
of the owner's ``StateFiles`` too, out of memory once written. Host memory: up to four shard copies (own and ward, current and pending) of 4 bytes x (1 +
element-wise states) per element, plus the whole-tensor state of the parameters the rank and
its ward are the assignees of, reported by ``nbytes``. The optimizer's state table (scalars such
as step counts) is merged over all ranks when a snapshot is taken, so any holder can restore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.collective.collective_api import Collective
from zero_ray.core.optim_state import bucket_kinds, merge_tables
from zero_ray.core.restore_plan import PeerRestore, SnapshotRecord, TransferDescription
from zero_ray.core.tensor_parallel_ranks import shard_moves
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.tensors.host_copy import host_copies
from zero_ray.owner.tensors.state_files import StateFiles
from zero_ray.owner.step.param_group import OptimizerSlice
from zero_ray.owner.resilience.resize import RankState, Staged, TransferPlan, WholeState, exchange, run_p2p


@dataclass(kw_only=True)
class Snapshot:
    """One rank's optimizer state over its own shard ranges, as of driver step ``step``."""

    rank: int
    step: int
    world_size: int
    state: RankState
    description: TransferDescription  # what a restore from it plans with: layout, merged table, counters

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state))


def _tensors(state: RankState) -> list[torch.Tensor]:
    """Every tensor of ``state`` in the order both sides of an exchange list them."""
    out = [t for s in state.slices for t in (s.master, *s.moments.values())]
    out += [state.whole[p][k] for p in sorted(state.whole) for k in sorted(state.whole[p])]
    return out


def _slices(engine: OwnerEngine, rank: int, kinds: list[list[str]], *, clone: bool) -> list[OptimizerSlice]:
    """World rank ``rank``'s shard range of every bucket with the state names ``kinds`` lists:
    cloned from this engine's state (``clone``; a name it never created is zeros), or zeroed
    buffers of the same shape to receive into. The layout is over the data-parallel group (with
    tensor parallelism, the D owners of this rank's TP shard), so the range is its DP rank's."""
    rank = engine.fabric.ranks.dp_rank(rank)
    out = []
    live = {s.bucket.index: s for s in engine.state.optimizer_slices()}
    files = engine.state.state_files  # offloaded: the copies live in files too, not in memory
    for b in engine.layout.buckets:
        lo, hi = b.shard_range(rank)
        s = live[b.index]  # every rank has the same buckets, trainable or frozen alike
        names = kinds[b.index][1:]
        if clone:
            held = [s.master[lo - s.start:hi - s.start]]
            held += [s.moments[k][lo - s.start:hi - s.start] if k in s.moments
                     else torch.zeros(hi - lo, dtype=torch.float32) for k in names]
            master, *rest = (host_copies(held, dtype=torch.float32) if files is None
                             else [files.zeros(t.numel()).copy_(t) for t in held])
        else:
            master, *rest = [torch.zeros(hi - lo, dtype=torch.float32) if files is None else files.zeros(hi - lo)
                             for _ in range(1 + len(names))]
        out.append(OptimizerSlice(bucket=b, start=lo, end=hi, master=master, moments=dict(zip(names, rest))))
    return out


def gather_objects(group: Collective, obj: Any) -> list[Any]:
    """``obj`` from every rank of ``group`` (small, picklable data)."""
    if group.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=getattr(group, "process_group", None))
    return out


class PeerSnapshots:
    """This owner's current and pending own/ward snapshots."""

    def __init__(self) -> None:
        self.own: Snapshot | None = None
        self.ward: Snapshot | None = None
        # A snapshot taken but not yet known finished everywhere; public so that a step asks
        # commit_upto only when there is one.
        self.pending: tuple[Snapshot, Snapshot | None] | None = None
        # Copies of a layout a resize or restore just installed, with the peers they went to:
        # they replace the old layout's only when the driver confirms that every rank has them
        # (``confirm_layout``), so a loss before that still finds every old partition twice.
        self._layout: tuple[Snapshot, Snapshot | None, int, int] | None = None
        self._from_layout = False  # own/ward are a confirmed new layout's copies (not a step's)

    def take(self, engine: OwnerEngine, group: Collective, *, step: int, backup: int, ward: int,
             timeout_s: float) -> int:
        """Snapshot after driver step ``step``: clone own state, send it to ``backup`` while
        receiving ``ward``'s (world ranks; with tensor parallelism both hold this rank's TP
        shard: ``core/reshard_plan.backup_peers``). Returns bytes sent."""
        import torch.distributed as dist

        rank, n = engine.rank, engine.world_size
        optimizer = engine.state.optimizer
        table = merge_tables(gather_objects(group, optimizer.table()))
        whole_plan = optimizer.whole_plan
        kinds = bucket_kinds(engine.layout, table)
        description = engine.transfer_description(table)  # a restore needs no live engine
        own_whole: WholeState = {p: dict(zip(sorted(st), host_copies([st[k] for k in sorted(st)])))
                                 for p, st in optimizer.whole_state(saver_only=True).items()}
        own = Snapshot(rank=rank, step=step, world_size=n, description=description,
                       state=RankState(slices=_slices(engine, rank, kinds, clone=True), whole=own_whole))
        engine.state.evict_state()  # offloaded state read for the copy goes back to its files
        theirs = None
        sent = 0
        if backup != rank:
            ward_whole: WholeState = {}
            for p in whole_plan.assigned_to(engine.fabric.ranks.dp_rank(ward)):  # assignees: DP ranks
                for key, desc in table.get(p, {}).get("whole", {}).items():
                    ward_whole.setdefault(p, {})[key] = torch.zeros(desc["shape"], dtype=getattr(torch, desc["dtype"]))
            theirs = Snapshot(rank=ward, step=step, world_size=n, description=description,
                              state=RankState(slices=_slices(engine, ward, kinds, clone=False), whole=ward_whole))
            pg = getattr(group, "process_group", None)
            ops: list[object] = []
            for i, t in enumerate(_tensors(own.state)):
                ops.append(dist.P2POp(dist.isend, t, backup, group=pg, tag=i))
                sent += t.numel() * t.element_size()
            for i, t in enumerate(_tensors(theirs.state)):
                ops.append(dist.P2POp(dist.irecv, t, ward, group=pg, tag=i))
            run_p2p(ops, me=rank, pg=pg, timeout_s=timeout_s, what="peer snapshot")
        files = engine.state.state_files
        if files is not None:  # written and sent: the copies' pages go back to their files
            for snapshot in (own, theirs):
                for t in _tensors(snapshot.state) if snapshot is not None else ():
                    files.evict(t)
        self.pending = (own, theirs)
        return sent

    def take_layout(self, engine: OwnerEngine, group: Collective, *, step: int, backup: int, ward: int,
                    timeout_s: float) -> int:
        """Copies of the layout just installed (after driver step ``step``), kept beside the old
        layout's until ``confirm_layout``. Returns bytes sent."""
        kept = self.pending
        try:
            sent = self.take(engine, group, step=step, backup=backup, ward=ward, timeout_s=timeout_s)
            own, theirs = self.pending  # type: ignore[misc]
            self._layout = (own, theirs, backup, ward)
        finally:
            self.pending = kept
        return sent

    def confirm_layout(self, backup: int, ward: int) -> bool:
        """Every rank holds its copies of the new layout (the driver saw every transfer end and
        now names the same peers): they become the committed snapshots, the old layout's go.
        False (nothing changed but the unconfirmed copies dropped) when there are none or they
        went to other peers."""
        layout, self._layout = self._layout, None
        if layout is None or layout[2:] != (backup, ward):
            return False
        self.own, self.ward = layout[0], layout[1]
        self.pending = None
        self._from_layout = True
        return True

    def drop_layout(self) -> None:
        """Forget unconfirmed copies of a new layout (its resize or restore did not complete)."""
        self._layout = None

    def settle_layout(self, *, complete: bool) -> tuple[int, int] | None:
        """A loss came before ``confirm_layout`` reached every owner. ``complete`` (every rank's
        transfer had ended): unconfirmed copies of the new layout are confirmed with the peers
        they went to (returned), an owner confirmed already keeps its copies, and one that took
        none (a shrink's surplus) holds nothing any more, its old-layout copies superseded.
        Otherwise the unconfirmed copies are dropped and the old layout's stay."""
        layout, self._layout = self._layout, None
        if not complete:
            return None
        if layout is not None:
            self.own, self.ward, self.pending = layout[0], layout[1], None
            self._from_layout = True
            return layout[2], layout[3]
        if not self._from_layout:
            self.own = self.ward = None
            self.pending = None
        return None

    def commit_upto(self, step: int) -> None:
        """Every rank finished driver step ``step``: a pending snapshot of it (or earlier) counts."""
        if self.pending is not None and self.pending[0].step <= step:
            self.own, self.ward = self.pending
            self.pending = None
            self._from_layout = False

    def drop_pending(self) -> None:
        self.pending = None

    def sources(self) -> dict[int, Snapshot]:
        """The committed snapshots held, by the rank they belong to."""
        return {s.rank: s for s in (self.own, self.ward) if s is not None}

    def info(self) -> dict[int, SnapshotRecord]:
        return {r: SnapshotRecord(step=s.step, world_size=s.world_size, description=s.description)
                for r, s in self.sources().items()}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._held())

    def file_bytes(self, files: StateFiles | None) -> int:
        """The part of ``nbytes`` in ``files`` (offloaded state: the copies live there too)."""
        if files is None:
            return 0
        return sum(t.numel() * t.element_size() for s in self._held() for t in _tensors(s.state) if files.holds(t))

    def _held(self) -> list[Snapshot]:
        held = [self.own, self.ward, *(self.pending or ()), *(self._layout or ())[:2]]
        return [s for s in held if s is not None]


def restore_from_peers(restore: PeerRestore, *, position: int, world_size: int, tensor_parallel: int,
                       sources: dict[int, RankState], group: Collective, timeout_s: float
                       ) -> tuple[TransferPlan, Staged, int]:
    """This actor's part of a restore from peer snapshots, as position ``position`` of a new
    ``world_size``-rank pool: ``sources`` are the snapshots it holds, by old world rank. Per TP
    shard (T = 1: one, over every rank) its DP owners' snapshots go to the positions taking that
    shard, a plan over D ranks, one shard after another on every actor (a holder may send one
    shard and take another). Returns the plan, what was staged for this position (to
    ``resize.install``) and the bytes sent."""
    tp = tensor_parallel
    plan = TransferPlan.of(restore.description, old_world=restore.old_world // tp, new_world=world_size // tp)
    staged = plan.staging(position // tp, world_size // tp)
    sent = 0
    for shard in shard_moves(size=tp, old_world=restore.old_world, new_world=world_size, holders=restore.holders):
        held = {d: sources[r] for d, r in enumerate(shard.old_ranks) if r in sources}
        sent += exchange(plan, me=position, sources=held, senders=list(shard.senders), staged=staged, group=group,
                         timeout_s=timeout_s, receivers=list(shard.receivers))
    return plan, staged, sent
