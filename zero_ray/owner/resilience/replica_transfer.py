"""An owner's part of a replica restore (``core/replica_plan.py``): with shard groups, the rebuilt
pool takes its state from a surviving group's *live* state, one G -> G transfer per new group.

Before the rebuild drops the old engine, a survivor keeps (host copies of) its own group rank's
shard; in each round it sends it (a sender) or receives its new group rank's shard (a
receiver), over the rebuilt pool's group. Nothing else is kept: no snapshot is involved.
"""

from __future__ import annotations

from zero_ray.collective.collective_api import Collective
from zero_ray.core.restore_plan import ReplicaRestore
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.tensors.host_copy import host_copies
from zero_ray.owner.resilience.redundancy import _slices
from zero_ray.owner.resilience.resize import RankState, Staged, TransferPlan, exchange


def live_state(engine: OwnerEngine | None, restore: ReplicaRestore) -> dict[int, RankState]:
    """This survivor's live shard, by its group rank (empty for a replacement, or an owner
    with no engine)."""
    if engine is None:
        return {}
    mesh = engine.fabric.mesh
    group_rank = mesh.position(engine.rank) % mesh.shard
    g = restore.plan.group_size
    plan = TransferPlan.of(restore.description, old_world=g, new_world=g)
    optimizer = engine.state.optimizer
    whole = {p: dict(zip(sorted(st), host_copies([st[k] for k in sorted(st)])))
             for p, st in optimizer.whole_state(saver_only=True).items()}
    return {group_rank: RankState(slices=_slices(engine, group_rank, plan.kinds, clone=True), whole=whole)}


def restore_replica(restore: ReplicaRestore, *, me: int, sources: dict[int, RankState], group: Collective,
                    timeout_s: float) -> tuple[TransferPlan, Staged | None, int]:
    """Run every round this position takes part in; returns the plan, what it received and
    bytes sent."""
    g = restore.plan.group_size
    plan = TransferPlan.of(restore.description, old_world=g, new_world=g)
    staged, sent = None, 0
    for rnd in restore.plan.rounds:
        senders, receivers = list(rnd.senders), list(rnd.receivers)
        if me not in senders and me not in receivers:
            continue
        mine = plan.staging(receivers.index(me), g) if me in receivers else None
        sent += exchange(plan, me=me, sources=sources, senders=senders, receivers=receivers, staged=mine,
                         group=group, timeout_s=timeout_s)
        if mine is not None:
            staged = mine
    return plan, staged, sent
