"""The driver's part of a replica restore (``core/replica_plan.py``): with shard groups, lost owners
are restored from a surviving group's live state, at a size that keeps the groups whole.

``replica_mesh`` says whether the source applies (the topology has replicas and a whole group
survived the loss); ``restore_from_replica`` checks that the surviving group is at one step and
was not updating (else its state may be half a step), merges the group's transfer description
(layout, state table, counters), lets surplus survivors go when fewer owners than survivors can
run (a partial group's members first), and rebuilds the pool with every new group receiving the
surviving group's shards. Returns the steps completed in the restored state.

``resize_groups`` resizes such a run the same way, by whole groups: a grow's new groups take the
first group's live state, a shrink's last groups leave. (The flat layout's resize,
``OwnerPool.resize``, moves ranges of one layout over every owner; shard groups have a layout
per group, so it does not apply.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set

from zero_ray.core.replica_plan import keep_whole_groups, replica_plan, surviving_group
from zero_ray.core.restore_plan import ReplicaRestore
from zero_ray.core.topology import Mesh, Topology, plan_mesh
from zero_ray.driver.pool import OwnerPool
from zero_ray.driver.pool_spec import check_resources
from zero_ray.driver.reports import ResizeReport
from zero_ray.errors import CheckpointError, ConfigError, OwnerLostError


def replica_mesh(pool: OwnerPool, topology: Topology, lost: Set[int]) -> Mesh | None:
    """The mesh the lost ranks belonged to, when a whole shard group of it survived; else None."""
    if topology.flat or topology.shard_group_size is None:
        return None
    try:
        mesh = plan_mesh(topology, [str(n.get("node_id", "")) for n in pool.nodes])
    except ConfigError:
        return None
    return mesh if surviving_group(mesh, lost) is not None else None


def restore_from_replica(pool: OwnerPool, topology: Topology, *, lost: Set[int], survivors: Sequence[int],
                         target: int, committed_step: int, timeout_s: float) -> int:
    old = replica_mesh(pool, topology, lost)
    source = surviving_group(old, lost) if old is not None else None
    if old is None or source is None:
        raise CheckpointError(f"no whole shard group survives the loss of ranks {sorted(lost)}")
    if target % old.shard:
        raise CheckpointError(f"a restore to {target} owners would break shard groups of {old.shard}")
    step = _finished_step(pool, source, timeout_s=timeout_s)
    if step > committed_step + 1:
        raise CheckpointError(f"the surviving shard group completed step {step}, past the failed step "
                              f"{committed_step + 2}: its state is not the one to replay from")
    kept = list(survivors)
    if target < len(kept):
        kept = keep_whole_groups(kept, source, target)
        pool.kill([r for r in survivors if r not in kept])  # their slots go back; the groups stay whole
    _rebuild_from(pool, topology, old, source=source, kept=kept, target=target, timeout_s=timeout_s)
    return step


def resize_groups(pool: OwnerPool, topology: Topology, world_size: int, *, timeout_s: float) -> ResizeReport:
    """Resize a run with shard groups by whole groups: a grow gives each new group the first
    group's live state (as a replica restore does), a shrink lets the last groups go and the
    kept ones re-form. ``world_size`` must be a multiple of the group size
    (``Topology.check_resize``). Returns what moved, as ``OwnerPool.resize`` does."""
    started, before = time.perf_counter(), pool.world_size
    lost = pool.find_lost(timeout_s=min(2.0, pool.spec.health_timeout_s))
    if lost:  # every owner must take part in the transfer: recover first
        rank = min(lost)
        raise OwnerLostError(f"cannot resize: partition owner {pool.where(rank)} is gone ({lost[rank]})", rank=rank)
    old = plan_mesh(topology, [str(n.get("node_id", "")) for n in pool.nodes])
    if world_size % old.shard:
        raise ConfigError(f"resize to {world_size} owners would break shard groups of {old.shard}: resize to a "
                          f"multiple of {old.shard}")
    source = old.order[:old.shard]
    _finished_step(pool, source, timeout_s=timeout_s)
    if world_size > before:
        check_resources(world_size=world_size, use_gpu=pool.spec.use_gpu,
                        num_cpus_per_owner=pool.spec.num_cpus_per_owner)
        kept = list(range(before))
    else:  # the first groups stay (the source among them); the others leave before the rebuild
        kept = keep_whole_groups(list(range(before)), source, world_size)
        surplus = [r for r in range(before) if r not in kept]
        if surplus == list(range(world_size, before)):
            pool.remove(range(world_size, before), close=True)
        else:
            pool.kill(surplus)
    sent = _rebuild_from(pool, topology, old, source=source, kept=kept, target=world_size, timeout_s=timeout_s)
    return ResizeReport(previous_world_size=before, world_size=world_size, bytes_sent=sent,
                        seconds=time.perf_counter() - started)


def _finished_step(pool: OwnerPool, group: Sequence[int], *, timeout_s: float) -> int:
    """The step ``group``'s owners have all finished (and none is updating), else CheckpointError:
    its state may be half a step."""
    statuses = pool.statuses(group, timeout_s=timeout_s)
    steps = {s.step for s in statuses}
    phases = {s.phase for s in statuses}
    if len(steps) != 1 or "updating" in phases or "starting" in phases:
        raise CheckpointError(f"the shard group {list(group)} is not at one finished step "
                              f"(steps {sorted(steps)}, phases {sorted(phases)})")
    return steps.pop()


def _rebuild_from(pool: OwnerPool, topology: Topology, old: Mesh, *, source: Sequence[int], kept: Sequence[int],
                  target: int, timeout_s: float) -> int:
    """Rebuild the pool from ``kept`` (old ranks, in order) to ``target`` owners, every new
    shard group receiving ``source``'s live shards; returns bytes sent."""
    info = pool.transfer_description(source, timeout_s=timeout_s)
    gone = set(range(old.world_size)) - set(kept)

    def plan(position: dict[int, int]) -> ReplicaRestore:
        new = plan_mesh(topology, [str(n.get("node_id", "")) for n in pool.nodes])
        return ReplicaRestore(plan=replica_plan(old, lost=gone, survivors=kept, new=new), description=info)

    return pool.rebuild(kept, target, restore=plan)
