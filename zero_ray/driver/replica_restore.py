"""The driver's part of a replica restore (``core/replica.py``): with shard groups, lost owners
are restored from a surviving group's live state, at a size that keeps the groups whole.

``replica_mesh`` says whether the source applies (the topology has replicas and a whole group
survived the loss); ``restore_from_replica`` checks that the surviving group is at one step and
was not updating (else its state may be half a step), merges the group's transfer description
(layout, state table, counters), lets surplus survivors go when fewer owners than survivors can
run (a partial group's members first), and rebuilds the pool with every new group receiving the
surviving group's shards. Returns the steps completed in the restored state.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from zero_ray.core.replica import keep_whole_groups, replica_plan, surviving_group
from zero_ray.core.topology import Mesh, Topology, plan_mesh
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CheckpointError, ConfigError
from zero_ray.owner.resize import merge_descriptions


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
    statuses = pool.fan.grpc([pool.clients[r] for r in source], "status",
                             lambda c, i: c.status(timeout_s=timeout_s), watch=False, ranks=list(source))
    steps = {s.step for s in statuses}
    phases = {s.phase for s in statuses}
    if len(steps) != 1 or "updating" in phases or "starting" in phases:
        raise CheckpointError(f"the surviving shard group {list(source)} is not at one finished step "
                              f"(steps {sorted(steps)}, phases {sorted(phases)})")
    step = steps.pop()
    if step > committed_step + 1:
        raise CheckpointError(f"the surviving shard group completed step {step}, past the failed step "
                              f"{committed_step + 2}: its state is not the one to replay from")
    info = merge_descriptions(pool.fan.grpc([pool.clients[r] for r in source], "resize_info",
                                            lambda c, i: c.resize_info(timeout_s=timeout_s), watch=False,
                                            ranks=list(source)))
    kept = list(survivors)
    if target < len(kept):
        kept = keep_whole_groups(kept, source, target)
        pool.kill([r for r in survivors if r not in kept])  # their slots go back; the groups stay whole
    gone = set(range(old.world_size)) - set(kept)

    def plan(position: dict[int, int]) -> dict[str, object]:
        new = plan_mesh(topology, [str(n.get("node_id", "")) for n in pool.nodes])
        return {**replica_plan(old, lost=gone, survivors=kept, new=new).to_data(), "scalars": info}

    pool.rebuild(kept, target, restore=plan)
    return step
