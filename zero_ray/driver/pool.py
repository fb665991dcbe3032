"""OwnerPool: the partition-owner actors of one run, their placement and their calls.

Remote failures come back as domain errors: a Ray task error becomes the cause's own domain
type (ConfigError, ModelError, ...) or an OwnerError, always with the remote traceback; a dead
actor becomes OwnerLostError naming its rank and node. Every wait is bounded.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient
from zero_ray.control.handlers import (
    EvaluateArgs,
    EvaluateResult,
    LoadResult,
    OwnerStats,
    SavePhase,
    SaveResult,
    StepArgs,
    StepResult,
)
from zero_ray.driver.health import HealthMonitor

from zero_ray import errors
from zero_ray.config import ControlTLS
from zero_ray.errors import (
    ConfigError,
    ControlError,
    OwnerError,
    OwnerLostError,
    ResourceError,
    ZeroRayError,
    domain_error,
)
from zero_ray.core.reshard import backup_peers
from zero_ray.owner.actor import OwnerOptions, RemotePartitionOwner
from zero_ray.owner.spec import EngineSpec

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    health_interval_s: float
    health_timeout_s: float
    tls: ControlTLS | None = None
    snapshot_every: int = 0  # peer snapshots every this many steps; 0: none

    def server_tls(self) -> dict[str, str | None]:
        """The TLS arguments of a control ServerConfig."""
        t = self.tls
        if t is None:
            return {}
        return {"tls_cert": t.cert, "tls_key": t.key, "tls_client_ca": t.ca if t.mutual else None}

    def client_tls(self) -> dict[str, str | None]:
        """The TLS arguments of a control ClientConfig."""
        t = self.tls
        if t is None:
            return {}
        return {"tls_ca": t.ca, "tls_cert": t.cert if t.mutual else None, "tls_key": t.key if t.mutual else None}


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
        return domain_error(type(cause), f"{where} failed in {method}: {cause}\n\nRemote traceback:\n{tb}", rank=rank,
                            fallback=f"{where} failed in {method}: {cause!r}", remote_traceback=tb)
    return OwnerError(f"{where} failed in {method}: {err!r}", rank=rank)


def _step_error(err: ControlError, where: str, rank: int, what: str = "step") -> ZeroRayError:
    """Rebuild the owner's domain error from the gRPC status ("Step: TypeName: message")."""
    cause = err.__cause__
    details = cause.details() if isinstance(cause, grpc.Call) else ""
    match = re.match(r"^[\w.]+: (\w+): (.*)$", details or "", flags=re.S)
    if match:
        return domain_error(getattr(errors, match.group(1), None), f"{where} failed in {what}: {match.group(2)}",
                            rank=rank)
    return OwnerError(f"{where} failed in {what}: {err}", rank=rank)


class OwnerPool:
    """The actors in rank order, their control clients and health, and bounded calls to them."""

    def __init__(self, spec: PoolSpec, engine: EngineSpec, *, credentials: Credentials) -> None:
        self.spec = spec
        self.run_id = credentials.job_id
        self.credentials = credentials
        self.generation = 0
        self.actors: list[ray.actor.ActorHandle] = []
        self.nodes: list[dict[str, Any]] = []
        self.clients: list[OwnerClient] = []
        self.health: HealthMonitor | None = None
        self._pg: Any = None
        self._extra_pgs: list[Any] = []  # placement groups of owners added by resize()
        # fit()'s datasets (name -> source, factory?, collate), registered on owners started later too
        self.datasets: dict[str, tuple[Any, bool, Any]] = {}
        # Steps may block for their whole deadline; aborts and stats must never queue behind them.
        self._executor = ThreadPoolExecutor(max_workers=3 * spec.world_size + 2, thread_name_prefix="zero_ray-rpc")
        check_resources(world_size=spec.world_size, use_gpu=spec.use_gpu, num_cpus_per_owner=spec.num_cpus_per_owner)
        bundle = {"GPU": 1.0, "CPU": 1.0} if spec.use_gpu else {"CPU": spec.num_cpus_per_owner}
        self._pg = placement_group([dict(bundle) for _ in range(spec.world_size)], strategy=spec.placement_strategy)
        try:
            ray.get(self._pg.ready(), timeout=spec.init_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(self._pg)
            self._pg = None
            raise ResourceError(f"could not reserve {spec.world_size} x {bundle} within {spec.init_timeout_s:g}s "
                                f"(available now: {ray.available_resources()}); free resources or lower world_size") from err
        self._options = OwnerOptions(backend=spec.backend, group_prefix=f"zero_ray-{self.run_id}",
                                     collective_timeout_s=spec.collective_timeout_s,
                                     threads=max(1, int(spec.num_cpus_per_owner)), credentials=credentials,
                                     control_host=None, local_cluster=_cluster_is_local(), server_tls=spec.server_tls(),
                                     snapshot_every=spec.snapshot_every)
        self._engine = engine
        try:
            self._start_owners(range(spec.world_size), world_size=spec.world_size, pg=self._pg)
            self.info = self.call("setup", timeout_s=spec.init_timeout_s)
            if spec.snapshot_every:
                self.assign_peers()
        except BaseException:
            self.shutdown()
            raise

    def _start_owners(self, ranks: range, *, world_size: int, pg: Any) -> None:
        """Start owners for ``ranks`` (bundle i of ``pg`` for the i-th), connect their control
        clients and (re)start the health monitor over every owner."""
        spec = self.spec
        new = [RemotePartitionOwner.options(
            num_cpus=1.0 if spec.use_gpu else spec.num_cpus_per_owner,
            num_gpus=1.0 if spec.use_gpu else 0.0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            max_concurrency=4,  # reports, re-forming and consolidation beside a step
            name=f"zero_ray-{self.run_id}-rank{rank}-g{self.generation}",
        ).remote(rank=rank, world_size=world_size, spec=self._engine, options=self._options)
            for i, rank in enumerate(ranks)]
        self.actors += new
        nodes = self._call_on(new, "node", timeout_s=spec.init_timeout_s, watch=False)
        self.nodes += nodes
        self.clients += [OwnerClient(ClientConfig(address=n["control_address"], credentials=self.credentials,
                                                  timeout_s=spec.init_timeout_s, **spec.client_tls()))
                         for n in nodes]
        self._restart_health()
        if self.datasets:
            self._register_datasets(new, self.datasets)

    def _restart_health(self) -> None:
        if self.health is not None:
            self.health.close()
        self.health = HealthMonitor(self.clients, interval_s=self.spec.health_interval_s,
                                    timeout_s=self.spec.health_timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def where(self, rank: int) -> str:
        node = self.nodes[rank] if rank < len(self.nodes) else {}
        return f"rank {rank}" + (f" on node {node.get('ip')} (pid {node.get('pid')})" if node else "")

    # -- Ray calls (lifecycle, reports) -----------------------------------------------------------
    def call(self, method: str, *args: Any, timeout_s: float, per_rank: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Call ``method`` on every owner through Ray; return results in rank order. The first
        failure is raised at once (the other ranks may be blocked on the failed one)."""
        return self._call_on(self.actors, method, *args, timeout_s=timeout_s, per_rank=per_rank)

    def _call_on(self, actors: Sequence[Any], method: str, *args: Any, timeout_s: float,
                 per_rank: Sequence[tuple[Any, ...]] | None = None, kwargs: Sequence[dict[str, Any]] | None = None,
                 watch: bool = True) -> list[Any]:
        refs = [getattr(a, method).remote(*(per_rank[r] if per_rank else args), **(kwargs[r] if kwargs else {}))
                for r, a in enumerate(actors)]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(rank_of[r] for r in pending)
                raise OwnerLostError(f"ranks {ranks} did not finish {method} within {timeout_s:g}s", rank=ranks[0])
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 0.5))
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except Exception as err:
                    raise _remote_error(err, rank, method, self.nodes) from err
            if watch:
                self._raise_if_lost(method)
        return [results[r] for r in range(len(refs))]

    def _raise_if_lost(self, method: str) -> None:
        lost = self.health.lost() if self.health is not None else {}
        if lost:
            rank = min(lost)
            raise OwnerLostError(f"partition owner {self.where(rank)} stopped answering during {method}: {lost[rank]}",
                                 rank=rank)

    # -- gRPC calls (the per-step loop) -----------------------------------------------------------
    def step(self, args: Sequence[StepArgs], *, timeout_s: float) -> list[StepResult]:
        """Run one step on every owner over gRPC, each call with a deadline. The first failure
        (an owner's error, a lost owner, the deadline) is raised at once."""
        return self._on_all("step", lambda c, r: c.step(args[r], timeout_s=timeout_s))

    def evaluate(self, args: Sequence[EvaluateArgs], *, timeout_s: float) -> list[EvaluateResult]:
        """A forward-only pass on every owner over gRPC (all take part: stage 3 gathers)."""
        return self._on_all("evaluate", lambda c, r: c.evaluate(args[r], timeout_s=timeout_s))

    def stage(self, key: str, pieces: Sequence[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Hand owner r its piece ``pieces[r]`` under ``key``, through a Ray call (Ray resolves
        and reference-counts the object; the Step naming ``key`` waits for it). Returns the
        calls' results, to hold until the step is over; a failed call shows as that step's
        error."""
        return [a.stage_batch.remote(key, piece) for a, piece in zip(self.actors, pieces)]

    def register_dataset(self, name: str, source: Any, *, factory: bool, collate: Any) -> int:
        """Have every owner (and every owner started later) hold dataset ``name``; its length."""
        self.datasets[name] = (source, factory, collate)
        lengths = self._register_datasets(self.actors, {name: self.datasets[name]})
        return lengths[0]

    def _register_datasets(self, actors: Sequence[Any], datasets: dict[str, tuple[Any, bool, Any]]) -> list[int]:
        lengths: list[int] = []
        for name, (source, factory, collate) in datasets.items():
            got = self._call_on(actors, "register_dataset", name, source, timeout_s=self.spec.init_timeout_s,
                                kwargs=[{"factory": factory, "collate": collate}] * len(actors), watch=False)
            if len(set(got)) > 1:
                raise ConfigError(f"dataset {name!r} has different lengths on the owners: {got}; a factory must "
                                  "build the same dataset everywhere")
            lengths += got[:1]
        return lengths

    def save(self, directory: str, step: int, *, phase: SavePhase, timeout_s: float) -> list[SaveResult]:
        """Every owner's half of a save into ``directory`` (see ``SavePhase``)."""
        return self._on_all("save", lambda c, r: c.save(directory, step, phase=phase, timeout_s=timeout_s))

    def load(self, path: str, *, timeout_s: float) -> list[LoadResult]:
        """Every owner restores its partition from the checkpoint at ``path``."""
        return self._on_all("load", lambda c, r: c.load(path, 0, timeout_s=timeout_s))

    def _on_all(self, what: str, call: Callable[[OwnerClient, int], T]) -> list[T]:
        futures = {self._executor.submit(call, c, r): r for r, c in enumerate(self.clients)}
        results: dict[int, T] = {}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            for fut in done:
                rank = futures[fut]
                try:
                    results[rank] = fut.result()
                except ControlError as err:
                    raise _step_error(err, self.where(rank), rank, what) from err
            self._raise_if_lost(what)
        return [results[r] for r in range(len(futures))]

    def abort(self, reason: str) -> None:
        """Abort the current generation's collectives on every owner that still answers."""
        lost = self.health.lost() if self.health is not None else {}
        calls = [self._executor.submit(c.abort, reason, self.generation, timeout_s=5.0)
                 for r, c in enumerate(self.clients) if r not in lost]
        wait(calls, timeout=10.0)

    def reform(self) -> bool:
        """Re-form the collective group as the next generation; returns whether every rank's
        model state is intact (no rank had begun its update)."""
        self.generation += 1
        consistent = self.call("reform", self.generation, timeout_s=self.spec.init_timeout_s)
        return all(consistent)

    def _reserve(self, count: int, *, timeout_s: float) -> Any:
        """A placement group for ``count`` more owners, or ResourceError (nothing reserved)."""
        bundle = {"GPU": 1.0, "CPU": 1.0} if self.spec.use_gpu else {"CPU": self.spec.num_cpus_per_owner}
        pg = placement_group([dict(bundle) for _ in range(count)], strategy=self.spec.placement_strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(pg)
            raise ResourceError(f"could not reserve {count} more x {bundle} within {timeout_s:g}s "
                                f"(available now: {ray.available_resources()})") from err
        self._extra_pgs.append(pg)
        return pg

    def resize_info(self, rank: int) -> dict[str, Any]:
        """The layout facts every actor of a reshard needs (from a live owner)."""
        return self._call_on(self.actors[rank:rank + 1], "resize_info", timeout_s=self.spec.init_timeout_s,
                             watch=False)[0]

    def resize(self, world_size: int) -> dict[str, Any]:
        """Continue with ``world_size`` owners: start the extra ones (growing), move every
        partition range whose owner changes directly between actors, stop the surplus ones
        (shrinking). Returns what moved and how long it took."""
        old = self.world_size
        start = time.perf_counter()
        lost = self.find_lost(timeout_s=min(2.0, self.spec.health_timeout_s))
        if lost:  # every owner must take part in the transfer: recover first
            rank = min(lost)
            raise OwnerLostError(f"cannot resize: partition owner {self.where(rank)} is gone ({lost[rank]})", rank=rank)
        info = self.resize_info(0)
        if world_size > old:
            check_resources(world_size=world_size, use_gpu=self.spec.use_gpu,
                            num_cpus_per_owner=self.spec.num_cpus_per_owner)  # raises before anything changes
            pg = self._reserve(world_size - old, timeout_s=self.spec.init_timeout_s)
            self._start_owners(range(old, world_size), world_size=world_size, pg=pg)
        self.generation += 1
        kwargs = [{"old_world": old, "new_world": world_size, "generation": self.generation, "info": info}
                  for _ in self.actors]
        sent = self._call_on(self.actors, "reshard", timeout_s=self.spec.init_timeout_s, kwargs=kwargs)
        if world_size < old:
            self.generation += 1  # the survivors re-formed a group of their own after the transfer
            surplus, clients = self.actors[world_size:], self.clients[world_size:]
            del self.actors[world_size:], self.clients[world_size:], self.nodes[world_size:]
            self._restart_health()  # before they stop, so their ending streams are not losses
            self._call_on(surplus, "close", timeout_s=30.0, watch=False)
            for actor in surplus:
                ray.kill(actor, no_restart=True)
            for client in clients:
                client.close()
        if self.spec.snapshot_every:
            self.assign_peers()
        return {"previous_world_size": old, "world_size": world_size, "bytes_sent": sum(sent),
                "seconds": time.perf_counter() - start}

    # -- membership after a loss --------------------------------------------------------------------
    def free_slots(self) -> int:
        """How many more owners the cluster could host right now."""
        free = ray.available_resources()
        if self.spec.use_gpu:
            return int(min(free.get("GPU", 0.0), free.get("CPU", 0.0)))
        return int(free.get("CPU", 0.0) // self.spec.num_cpus_per_owner)

    def find_lost(self, *, timeout_s: float) -> dict[int, str]:
        """Ranks that are gone: those the health monitor lost, and those that do not answer a
        control call within ``timeout_s`` (a dead process refuses at once; its heartbeat stream
        may not have noticed yet). Served on gRPC threads, so a rank blocked in a collective
        still answers."""
        lost = dict(self.health.lost()) if self.health is not None else {}
        # Ray knows an actor is dead (ray.kill, node loss) before its process has gone.
        refs = {a.node.remote(): r for r, a in enumerate(self.actors) if r not in lost}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                lost[refs[ref]] = f"Ray reports the actor dead: {str(err).splitlines()[0]}"
        futures = {r: self._executor.submit(c.stats, timeout_s=timeout_s) for r, c in enumerate(self.clients)
                   if r not in lost}
        for r, fut in futures.items():
            try:
                fut.result(timeout=timeout_s + 1)
            except Exception as err:  # unreachable, timed out, or refusing: gone for our purposes
                lost[r] = f"no answer to a control call within {timeout_s:g}s: {err}"
        return lost

    def assign_peers(self) -> list[int]:
        """Tell every owner which peer keeps its snapshots (another node when there is one)."""
        backup = backup_peers([n.get("node_id", "") for n in self.nodes])
        ward = [0] * len(backup)
        for r, b in enumerate(backup):
            ward[b] = r
        self.call("set_peers", timeout_s=self.spec.init_timeout_s, per_rank=list(zip(backup, ward)))
        return backup

    def snapshot_info(self, ranks: Sequence[int], committed_step: int) -> dict[int, dict[int, Any]]:
        """Per surviving rank: the committed snapshots it holds (by the rank they belong to)."""
        infos = self._call_on([self.actors[r] for r in ranks], "snapshot_info", committed_step,
                              timeout_s=self.spec.collective_timeout_s + 30, watch=False)
        return dict(zip(ranks, infos))

    def rebuild(self, survivors: Sequence[int], world_size: int, *,
                restore: Callable[[dict[int, int]], dict[str, Any] | None]) -> None:
        """Continue with the ``survivors`` (old ranks, keeping their order) plus new owners up to
        ``world_size``; ``restore(position_of_old_rank)`` gives the snapshot transfer (or None for
        fresh state, a checkpoint being loaded next)."""
        position = {old: new for new, old in enumerate(survivors)}
        pg = self._reserve(world_size - len(survivors), timeout_s=min(self.spec.init_timeout_s, 5.0)) \
            if world_size > len(survivors) else None
        keep = set(survivors)
        for r, client in enumerate(self.clients):
            if r not in keep:
                client.close()
        self.actors = [self.actors[r] for r in survivors]
        self.nodes = [self.nodes[r] for r in survivors]
        self.clients = [self.clients[r] for r in survivors]
        self.generation += 1
        if pg is not None:
            self._start_owners(range(len(survivors), world_size), world_size=world_size, pg=pg)
        else:
            self._restart_health()
        plan = restore(position)
        kwargs = [{"position": p, "world_size": world_size, "generation": self.generation, "restore": plan}
                  for p in range(world_size)]
        self._call_on(self.actors, "rebuild", timeout_s=self.spec.init_timeout_s, kwargs=kwargs)
        if self.spec.snapshot_every:
            self.assign_peers()

    def stats(self, *, timeout_s: float) -> list[OwnerStats | None]:
        futures = [self._executor.submit(c.stats, timeout_s=timeout_s) for c in self.clients]
        out: list[OwnerStats | None] = []
        for fut in futures:
            try:
                out.append(fut.result(timeout=timeout_s + 1))
            except Exception:  # a status query must not fail because one owner is busy or gone
                out.append(None)
        return out

    def kill(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            ray.kill(self.actors[rank], no_restart=True)

    def shutdown(self) -> None:
        """Stop the owners and release their placement group."""
        if self.health is not None:
            self.health.close()
        lost = self.health.lost() if self.health is not None else {}
        live = [a for r, a in enumerate(self.actors) if r not in lost]
        if live:
            try:
                ray.get([a.close.remote() for a in live], timeout=10)
            except Exception:  # owners stuck in a collective cannot close; they are killed next
                log.debug("owners did not close cleanly", exc_info=True)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        for client in self.clients:
            client.close()
        self.clients = []
        self._executor.shutdown(wait=False, cancel_futures=True)
        for pg in [self._pg, *self._extra_pgs]:
            if pg is not None:
                remove_placement_group(pg)
        self._pg, self._extra_pgs = None, []


def _cluster_is_local() -> bool:
    """Every node of the cluster is this machine: the control plane can stay on loopback."""
    try:
        here = ray.util.get_node_ip_address()
        return all(n.get("NodeManagerAddress") == here for n in ray.nodes() if n.get("Alive"))
    except Exception:
        return False
