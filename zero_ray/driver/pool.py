"""OwnerPool: the partition-owner actors of one run, their placement and their calls.

Remote failures come back as domain errors: a Ray task error becomes the cause's own domain
type (ConfigError, ModelError, ...) or an OwnerError, always with the remote traceback; a dead
actor becomes OwnerLostError naming its rank and node. Every wait is bounded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zero_ray.errors import OwnerError, OwnerLostError, ResourceError, ZeroRayError
from zero_ray.owner.actor import RemotePartitionOwner
from zero_ray.owner.engine import EngineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """How to place and start the owners."""

    world_size: int
    use_gpu: bool
    num_cpus_per_owner: float
    backend: str
    placement_strategy: str
    collective_timeout_s: float
    init_timeout_s: float


def check_resources(*, world_size: int, use_gpu: bool, num_cpus_per_owner: float) -> None:
    """Fail fast, naming the resources, when the cluster can never host the owners."""
    total = ray.cluster_resources()
    if use_gpu:
        need, have, what = float(world_size), total.get("GPU", 0.0), "GPU"
        hint = "lower world_size or add GPU nodes"
    else:
        need, have, what = world_size * num_cpus_per_owner, total.get("CPU", 0.0), "CPU"
        hint = ("lower world_size, add nodes, or start Ray with more logical CPUs "
                "(ray.init(num_cpus=...)); or lower num_cpus_per_owner")
    if have < need:
        raise ResourceError(f"world_size={world_size} needs {need:g} {what} ({'1 GPU' if use_gpu else f'{num_cpus_per_owner:g} CPU'} "
                            f"per partition owner) but the Ray cluster has {have:g} {what}; {hint}")


def _remote_error(err: Exception, rank: int, method: str, nodes: Sequence[dict[str, Any]]) -> ZeroRayError:
    node = nodes[rank] if rank < len(nodes) else {}
    where = f"rank {rank}" + (f" on node {node.get('ip')} (pid {node.get('pid')})" if node else "")
    if isinstance(err, ray.exceptions.RayActorError):
        return OwnerLostError(f"partition owner {where} died during {method}: {err}", rank=rank)
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause
        tb = str(err)
        if isinstance(cause, ZeroRayError) and not isinstance(cause, OwnerError):
            try:
                return type(cause)(f"{where} failed in {method}: {cause}\n\nRemote traceback:\n{tb}")
            except TypeError:
                pass
        return OwnerError(f"{where} failed in {method}: {cause!r}", rank=rank, remote_traceback=tb)
    return OwnerError(f"{where} failed in {method}: {err!r}", rank=rank)


class OwnerPool:
    """The actors, in rank order, and bounded calls to all of them."""

    def __init__(self, spec: PoolSpec, engine: EngineSpec) -> None:
        self.spec = spec
        self.run_id = uuid.uuid4().hex[:12]
        self.generation = 0
        self.actors: list[ray.actor.ActorHandle] = []
        self.nodes: list[dict[str, Any]] = []
        check_resources(world_size=spec.world_size, use_gpu=spec.use_gpu, num_cpus_per_owner=spec.num_cpus_per_owner)
        bundle = {"GPU": 1.0, "CPU": 1.0} if spec.use_gpu else {"CPU": spec.num_cpus_per_owner}
        self._pg = placement_group([dict(bundle) for _ in range(spec.world_size)], strategy=spec.placement_strategy)
        try:
            ray.get(self._pg.ready(), timeout=spec.init_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(self._pg)
            raise ResourceError(f"could not reserve {spec.world_size} x {bundle} within {spec.init_timeout_s:g}s "
                                f"(available now: {ray.available_resources()}); free resources or lower world_size") from err
        group_name = f"zero_ray-{self.run_id}-g{self.generation}"
        for rank in range(spec.world_size):
            options: dict[str, Any] = {
                "num_cpus": 1.0 if spec.use_gpu else spec.num_cpus_per_owner,
                "num_gpus": 1.0 if spec.use_gpu else 0.0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                "max_concurrency": 4,  # reports and consolidation may be served beside a step
                "name": f"{group_name}-rank{rank}",
            }
            self.actors.append(RemotePartitionOwner.options(**options).remote(
                rank=rank, world_size=spec.world_size, spec=engine, backend=spec.backend, group_name=group_name,
                collective_timeout_s=spec.collective_timeout_s, threads=max(1, int(spec.num_cpus_per_owner))))
        try:
            self.nodes = self.call("node", timeout_s=spec.init_timeout_s)
            self.info = self.call("setup", timeout_s=spec.init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any, timeout_s: float, per_rank: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Call ``method`` on every owner; return results in rank order. The first failure is
        raised at once (the other ranks may be blocked on the failed one)."""
        refs = [getattr(a, method).remote(*(per_rank[r] if per_rank else args)) for r, a in enumerate(self.actors)]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(rank_of[r] for r in pending)
                raise OwnerLostError(f"ranks {ranks} did not finish {method} within {timeout_s:g}s", rank=ranks[0])
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except Exception as err:
                    raise _remote_error(err, rank, method, self.nodes) from err
        return [results[r] for r in range(len(refs))]

    def shutdown(self) -> None:
        """Stop the owners and release their placement group."""
        if self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=10)
            except Exception:  # owners stuck in a collective cannot close; they are killed next
                log.debug("owners did not close cleanly", exc_info=True)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
