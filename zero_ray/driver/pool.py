"""OwnerPool: the run's membership. Which actors are the owners, in rank order, where they are,
their control clients and health; starting, adopting, resizing, rebuilding and stopping them.

Placement follows membership (``core/placement.py``): each owner is a plain Ray actor asking for
its own slot, so the slot is the cluster's again the moment the owner is gone (lost, shrunk away
or shut down) and a replacement can take it. Every call to the owners goes through ``FanOut``
(one bounded wait that aborts the survivors on a loss). The transport follows one rule: Ray
creates, places and kills owners and carries data (``node`` at start-up, the staged batch
pieces, datasets, filesystem objects, the consolidation's fragments); every control operation
on a live owner is a gRPC method of its control service. Liveness is read from Ray's registry of
named actors and from gRPC, never by calling the actor.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from zero_ray.control.auth import Credentials
from zero_ray.control.client import OwnerClient
from zero_ray.control.rank_watch import RankHealthWatch, SubtreeHealthMonitor
from zero_ray.control.handlers import (
    Flight,
    LoadResult,
    OwnerStats,
    OwnerStatus,
    RankStatus,
    SavePhase,
    SaveResult,
)
from zero_ray.core.placement import NodeRoom, Target, place_groups
from zero_ray.core.ray_names import NAMESPACE
from zero_ray.core.reply_combine import CombinedStep, CombinedTotals, combine_steps
from zero_ray.core.reshard_plan import backup_peers
from zero_ray.core.restore_plan import (
    Peers,
    ReshardPlan,
    RestorePlan,
    SnapshotRecord,
    TransferDescription,
    restore_to_data,
)
from zero_ray.driver.batch_staging import EvaluateCommand, Outgoing, StepCommand
from zero_ray.driver.fanout import FanOut, Members, StepFlight
from zero_ray.driver.health import HealthMonitor
from zero_ray.driver.model_view import Adopted, ModelView
from zero_ray.driver.owner_names import actor_alive, owner_name
from zero_ray.driver.relay_plane import RelayPlane
from zero_ray.driver.pool_spec import PoolSpec, await_room, check_resources, cluster_is_local
from zero_ray.driver.replacements import Replacements
from zero_ray.driver.reports import ResizeReport, comm_row
from zero_ray.driver.terminate import end_process
from zero_ray.errors import ConfigError, OwnerLostError, ResourceError
from zero_ray.owner.service.actor import OwnerOptions, RemotePartitionOwner
from zero_ray.owner.step.run_spec import EngineSpec

log = logging.getLogger(__name__)


class OwnerPool:
    """The owners in rank order, their placement, control clients and health."""

    def __init__(self, spec: PoolSpec, engine: EngineSpec, *, credentials: Credentials,
                 adopt: Adopted | None = None) -> None:
        self.spec = spec
        self.run_id = credentials.job_id
        self.credentials = credentials
        # clients, nodes, health and generation: the fan-out reads them there (fanout.Members)
        self.members = Members(generation=adopt.generation if adopt is not None else 0)
        self.actors: list[Any] = []
        # fit()'s datasets (name -> source, factory?, collate), registered on owners started later too
        self.datasets: dict[str, tuple[Any, bool, Any]] = {}
        # Checkpoint filesystem objects (key -> filesystem), handed to owners started later too
        self.filesystems: dict[str, Any] = {}
        self.fan = FanOut(world_size=spec.world_size, members=self.members)
        # Steps go down the relay tree from RelayConfig.min_owners owners on (re-planned on every membership change).
        self.relays = RelayPlane(config=spec.relays, members=self.members, fan=self.fan,
                                 client_config=lambda address: spec.client_config(address, credentials))
        self._relayed = False  # steps take the relay tree (set on every membership change)
        self._staging: dict[str, list[ray.ObjectRef]] = {}  # the staging calls of the batch in flight, by key
        # Every rank's transfer of a resize or restore ended but SetPeers has not confirmed the new
        # layout's peer copies on every owner yet: a recovery then counts them (owner/resilience/redundancy.py).
        self._layout_unconfirmed = False
        self.replacements = Replacements()  # owners started for a later grow (after a loss)
        self._replacement_starts = 0
        self._options = OwnerOptions(backend=spec.backend, group_prefix=f"zero_ray-{self.run_id}",
                                     collective_timeout_s=spec.collective_timeout_s,
                                     threads=max(1, int(spec.num_cpus_per_owner)), credentials=credentials,
                                     control_host=None, local_cluster=cluster_is_local(), server_tls=spec.server_tls(),
                                     client_tls=spec.client_tls(),
                                     snapshot_every=spec.snapshot_every, settle_timeout_s=spec.settle_timeout_s,
                                     detached=spec.detached, orphan_timeout_s=spec.orphan_timeout_s,
                                     run=spec.run)
        self._engine = engine
        try:
            if adopt is not None:
                self._connect(adopt.actors)
                self.model = ModelView.of(adopt.layout)
            else:
                self._start_owners(range(spec.world_size), world_size=spec.world_size, wait_for_room=True)
                setups = self.fan.grpc(self.clients, "setup", lambda c, r: c.setup(timeout_s=spec.init_timeout_s))
                self.model = ModelView.of(setups[0].layout)  # the same on every owner
            if spec.snapshot_every:
                self.assign_peers()
        except BaseException:
            self.shutdown()
            raise

    # -- membership ---------------------------------------------------------------------------------
    def _targets(self, ranks: range) -> list[Target]:
        nodes = [NodeRoom(node_id=n["NodeID"], total=n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
        return place_groups(self.spec.placement_strategy, ranks=ranks, group_size=self.spec.tensor_parallel,
                            demand=self.spec.demand, nodes=nodes, occupied=[n.get("node_id", "") for n in self.nodes])

    def _launch(self, ranks: range, world_size: int, *, start: int = 0) -> list[Any]:
        """Create owner actors for ``ranks`` of a ``world_size``-owner pool (each asking Ray for
        its own slot); returns at once. ``start`` > 0: replacements started ahead of a grow,
        standby owners until it takes them in (``driver/replacements.py``)."""
        spec = self.spec
        options = dataclasses.replace(self._options, standby=True) if start else self._options
        new = []
        for rank, target in zip(ranks, self._targets(ranks)):
            strategy: Any = "DEFAULT"
            if target.node is not None:
                strategy = NodeAffinitySchedulingStrategy(target.node, soft=False)
            elif target.spread:
                strategy = "SPREAD"
            new.append(RemotePartitionOwner.options(
                num_cpus=spec.demand["CPU"], num_gpus=spec.demand.get("GPU", 0.0), scheduling_strategy=strategy,
                max_concurrency=4,  # reports, re-forming and consolidation beside a step
                name=owner_name(self.run_id, rank, self.generation, start), namespace=NAMESPACE,
                lifetime="detached" if spec.detached else None,
            ).remote(rank=rank, world_size=world_size, spec=self._engine, options=options))
        return new

    def _start_owners(self, ranks: range, *, world_size: int, wait_for_room: bool = False) -> None:
        """Start owners for ``ranks`` (or take the replacements already started for them),
        connect their control clients and restart the health monitor over every owner. With
        ``wait_for_room`` (start-up) the owners are created first, their pending requests being
        what an autoscaler sees, and the wait for nodes with room for them all is bounded by
        ``capacity_timeout_s`` (``pool_spec.await_room``). Owners that cannot be placed in time, or
        whose start takes longer than the start-up timeout, are ended and ResourceError raised:
        nothing is kept."""
        spec = self.spec
        if wait_for_room and not spec.capacity_timeout_s:  # no wait: fail before creating any owner
            await_room(owners=len(self.actors) + len(ranks), demand=spec.demand, bound_s=0.0)
        new = self.replacements.take(ranks)
        new += self._launch(ranks[len(new):], world_size)
        try:
            if wait_for_room:
                await_room(owners=len(self.actors) + len(new), demand=spec.demand, bound_s=spec.capacity_timeout_s)
            nodes = self.fan.ray(new, "node", timeout_s=spec.init_timeout_s, watch=False, ranks=list(ranks))
        except OwnerLostError as err:
            for actor in new:
                ray.kill(actor, no_restart=True)
            free = {k: v for k, v in ray.available_resources().items() if k in spec.demand}
            raise ResourceError(f"{len(new)} new owners of {spec.demand} could not all start within "
                                f"init_timeout_s={spec.init_timeout_s:g}s (free now: {free}; other work may hold the "
                                f"slots the nodes have room for): {err}") from err
        except BaseException:
            for actor in new:
                ray.kill(actor, no_restart=True)
            raise
        self._connect(new, nodes)

    def start_replacements(self, world_size: int) -> None:
        """Start owners that a grow to ``world_size`` will take in, without waiting for them
        (``driver/replacements.py``). In a detached run they are detached standby owners: an
        attaching driver ends them, and untaken they end themselves after ``orphan_timeout_s``,
        so this driver takes them only within half that."""
        if world_size <= self.world_size:
            return
        self._replacement_starts += 1
        start = self._replacement_starts
        self.replacements.start(range(self.world_size, world_size), world_size,
                                lambda ranks, size: self._launch(ranks, size, start=start),
                                keep_s=self.spec.orphan_timeout_s / 2 if self.spec.detached else None)

    def _connect(self, actors: list[Any], nodes: list[dict[str, Any]] | None = None) -> None:
        spec = self.spec
        if nodes is None:
            nodes = self.fan.ray(actors, "node", timeout_s=spec.init_timeout_s, watch=False)
        self.actors += actors
        self.members.nodes += nodes
        self.members.clients += [OwnerClient(spec.client_config(n["control_address"], self.credentials))
                                 for n in nodes]
        self.fan.fit(len(self.actors))
        self._membership_changed()
        if self.datasets:
            self._register_datasets(actors, self.datasets)
        for key, fs in self.filesystems.items():
            self.fan.ray(actors, "use_filesystem", key, fs, timeout_s=spec.init_timeout_s, watch=False)

    def _membership_changed(self) -> None:
        """Re-plan the relay tree over the members of now and watch them anew: through the top
        relays' Watch streams on the tree (each relay reads its children's; a relay's loss is its
        host rank's), else every owner's Health stream."""
        if self.health is not None:
            self.health.close()
            self.members.watch(None)
        interval, timeout = self.spec.health_interval_s, self.spec.health_timeout_s
        try:
            self.relays.replan()
        finally:  # a failed re-plan (a host lost mid-HostRelays) leaves no tree: watch every owner
            # Whether steps take the tree is known here, once per membership, not asked per step.
            self._relayed = self.relays.active
            self.members.watch(
                SubtreeHealthMonitor(self.relays.top_children, interval_s=interval, timeout_s=timeout)
                if self._relayed else HealthMonitor(self.clients, interval_s=interval, timeout_s=timeout))

    def _lost(self) -> dict[int, str]:
        return self.members.lost()

    @property
    def clients(self) -> list[OwnerClient]:
        """Each owner's control client, in rank order."""
        return self.members.clients

    @property
    def nodes(self) -> list[dict[str, Any]]:
        """Each owner's node record (``node`` at start-up), in rank order."""
        return self.members.nodes

    @property
    def health(self) -> RankHealthWatch | None:
        return self.members.health

    @property
    def generation(self) -> int:
        """The collective group's generation (one more on every re-forming, resize and rebuild)."""
        return self.members.generation

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def tensor_parallel(self) -> int:
        """T: owners ``d T .. d T + T - 1`` form TP group d and read data-parallel rank d's piece."""
        return self.spec.tensor_parallel

    def where(self, rank: int) -> str:
        return self.members.where(rank)

    def free_slots(self) -> int:
        """How many more owners the cluster could host right now, counting the slots of the
        replacements starting (the next membership change takes them in or ends them)."""
        free = ray.available_resources()
        return int(min(free.get(k, 0.0) // v for k, v in self.spec.demand.items())) + self.replacements.slots

    # -- calls ---------------------------------------------------------------------------------------
    def start_step(self, command: StepCommand, *, timeout_s: float) -> StepFlight:
        """Send a step to every owner, with a deadline, and return at once (``collect`` waits for
        it; a failed staging call of its pieces fails it at once): down the relay tree when the
        pool has one (``driver/relay_plane.py``), else to each owner directly."""
        staged = self._staged(command.step.piece.batch_key)
        if self._relayed:
            return StepFlight(calls=self.relays.start_step(command, timeout_s=timeout_s, staged=staged), relayed=True)
        args = command.per_rank()
        return StepFlight(calls=self.fan.start(self.clients, "step", lambda c, r: c.step_async(
            args[r], timeout_s=timeout_s), staged=staged), relayed=False)

    def collect(self, flight: StepFlight) -> CombinedStep:
        """Every owner's reply to the step ``flight`` sent (``start_step``), combined."""
        if flight.relayed:
            return self.relays.collect(flight.calls)
        return combine_steps(CombinedStep.of(r) for r in self.fan.collect(flight.calls))

    def evaluate(self, command: EvaluateCommand, *, timeout_s: float) -> CombinedTotals:
        """A forward-only pass on every owner (all take part: stage 3 gathers), their loss totals
        combined: down the relay tree when the pool has one, else to each owner directly."""
        staged = self._staged(command.evaluate.piece.batch_key)
        if self._relayed:
            return self.relays.evaluate(command, timeout_s=timeout_s, staged=staged).totals
        args = command.per_rank()
        return sum((CombinedTotals.of(r.totals, rank=r.rank) for r in self.fan.grpc(
            self.clients, "evaluate", lambda c, r: c.evaluate(args[r], timeout_s=timeout_s), staged=staged)),
                   CombinedTotals())

    def _staged(self, key: str) -> dict[int, ray.ObjectRef]:
        """The staging calls of the batch staged as ``key`` (none for a dataset's pieces), by rank."""
        return dict(enumerate(self._staging.pop(key, [])))

    def save(self, directory: str, step: int, *, phase: SavePhase, timeout_s: float) -> list[SaveResult]:
        """Every owner's half of a save into ``directory`` (see ``SavePhase``)."""
        return self.fan.grpc(self.clients, "save", lambda c, r: c.save(directory, step, phase=phase,
                                                                         timeout_s=timeout_s))

    def load(self, path: str, *, timeout_s: float) -> list[LoadResult]:
        """Every owner restores its partition from the checkpoint at ``path``."""
        return self.fan.grpc(self.clients, "load", lambda c, r: c.load(path, 0, timeout_s=timeout_s))

    def use_filesystem(self, key: str, fs: Any) -> None:
        """Have every owner (and every owner started later) hold the checkpoint filesystem object
        ``fs`` under ``key``, so that the locations naming it open there (a Ray call: it is
        pickled, credentials and all, as Ray Train ships its storage_filesystem)."""
        if key not in self.filesystems:
            self.filesystems[key] = fs
            self.fan.ray(self.actors, "use_filesystem", key, fs, timeout_s=self.spec.init_timeout_s, watch=False)

    def stage(self, out: Outgoing) -> list[ray.ObjectRef]:
        """Hand owner r its object ``out.objects[r]`` under ``out.key``, through a Ray call (Ray
        resolves and reference-counts the object; the Step naming the key waits for it). Returns
        the calls' results, to hold until the step is over; a failed call fails the Step or
        Evaluate naming the key at once with its error. Nothing to stage (a dataset's pieces):
        no call."""
        if not out.objects:
            return []
        calls = [a.stage_batch.remote(out.key, piece) for a, piece in zip(self.actors, out.objects)]
        self._staging = {out.key: calls}  # one batch is in flight at a time (the trainer's step mutex)
        return calls

    def register_dataset(self, name: str, source: Any, *, factory: bool, collate: Any) -> int:
        """Have every owner (and every owner started later) hold dataset ``name``; its length."""
        self.datasets[name] = (source, factory, collate)
        # Watched: on a formed pool a frozen owner is lost within health_timeout_s (the soak's
        # SIGSTOP here waited out init_timeout_s, 120 s). _connect's registration stays unwatched.
        return self._register_datasets(self.actors, {name: self.datasets[name]}, watch=True)[0]

    def _register_datasets(self, actors: Sequence[Any], datasets: dict[str, tuple[Any, bool, Any]], *,
                           watch: bool = False) -> list[int]:
        lengths: list[int] = []
        for name, (source, factory, collate) in datasets.items():
            got = self.fan.ray(actors, "register_dataset", name, source, timeout_s=self.spec.init_timeout_s,
                               kwargs=[{"factory": factory, "collate": collate}] * len(actors), watch=watch)
            if len(set(got)) > 1:
                raise ConfigError(f"dataset {name!r} has different lengths on the owners: {got}; a factory must "
                                  "build the same dataset everywhere")
            lengths += got[:1]
        return lengths

    def rank_statuses(self) -> list[RankStatus]:
        """Each owner's node, health and memory, for an operator's status."""
        health = self.health.snapshot() if self.health else []
        stats = self.stats(timeout_s=2.0)
        ranks = []
        for r, node in enumerate(self.nodes):
            hr = health[r] if r < len(health) else None
            st = stats[r] if r < len(stats) else None
            ranks.append(RankStatus(rank=r, node=f"{node.get('ip')} pid {node.get('pid')}",
                                    healthy=hr.healthy if hr else False,
                                    state=(hr.state if hr and hr.healthy else f"lost: {hr.lost_reason}") if hr else "?",
                                    last_heartbeat=hr.last_beat if hr else 0.0,
                                    memory=dict(st.memory_bytes) if st else {}))
        return ranks

    def stats(self, *, timeout_s: float) -> list[OwnerStats | None]:
        """Every owner's counters, None for an owner that does not answer: a status query must
        not fail because one owner is busy or gone."""
        got = self.fan.urgent(dict(enumerate(self.clients)), lambda c: c.stats(timeout_s=timeout_s),
                              timeout_s=timeout_s + 1)
        out: list[OwnerStats | None] = []
        for rank in range(len(self.clients)):
            result = got[rank]
            out.append(None if isinstance(result, Exception) else result)
        return out

    def _all_stats(self, timeout_s: float) -> list[OwnerStats]:  # through the relay tree when the pool has one
        if self._relayed:
            return self.relays.stats(timeout_s=timeout_s)
        return self.fan.grpc(self.clients, "stats", lambda c, r: c.stats(timeout_s=timeout_s), watch=False)

    def memory_reports(self, *, timeout_s: float) -> list[dict[str, int]]:
        """Per rank, its memory report (``Stats``), with its rank."""
        return [{"rank": s.rank, **s.memory_bytes} for s in self._all_stats(timeout_s)]

    def comm_reports(self, *, timeout_s: float) -> list[dict[str, int]]:
        """Per rank, bytes sent in the last step by collective, their total, the tensor-parallel
        layers' part (``tensor_parallel``: every ``tp_*`` count) and ZeRO's (``data_parallel``: the
        rest), and how much went to owners on the same node and to others (``inside_node`` /
        ``cross_node``)."""
        return [comm_row(s) for s in self._all_stats(timeout_s)]

    def flights(self, *, timeout_s: float) -> tuple[list[Flight], list[int]]:
        """Every owner's flight record (served on gRPC threads: a rank blocked in a collective or
        in compute answers), and the ranks that did not answer within ``timeout_s``."""
        got = self.fan.urgent(dict(enumerate(self.clients)), lambda c: c.flight(timeout_s=timeout_s),
                              timeout_s=timeout_s + 1)
        flights = [f for f in got.values() if not isinstance(f, Exception)]
        return flights, sorted(r for r, f in got.items() if isinstance(f, Exception))

    def master_fragments(self, *, timeout_s: float) -> list[dict[str, tuple[int, int, Any]]]:
        """Every owner's fp32 master fragments (the explicit consolidation: tensors, so through Ray)."""
        return self.fan.ray(self.actors, "master_fragments", timeout_s=timeout_s)

    # -- failures -------------------------------------------------------------------------------------
    def abort(self, reason: str, *, lost: Sequence[int] = ()) -> None:
        """Abort the current generation's collectives on every owner that still answers (not
        waiting for the ``lost`` ranks: Ray may know one dead before its heartbeats stop)."""
        self.fan.abort(reason, lost=lost)

    def find_lost(self, *, timeout_s: float) -> dict[int, str]:
        """Ranks that are gone: those the health monitor lost, and those that do not answer a
        control call within ``timeout_s`` (a dead process refuses at once; its heartbeat stream
        may not have noticed yet). Served on gRPC threads, so a rank blocked in a collective
        still answers."""
        lost = dict(self._lost())
        # Ray knows an actor is dead (ray.kill, node loss) before its process has gone.
        for r, node in enumerate(self.nodes):
            if r not in lost and not actor_alive(node.get("name")):
                lost[r] = f"Ray reports the actor {node.get('name')} dead"
        probes = self.fan.urgent({r: c for r, c in enumerate(self.clients) if r not in lost},
                                 lambda c: c.stats(timeout_s=timeout_s), timeout_s=timeout_s + 1)
        for r, result in probes.items():
            if isinstance(result, Exception):  # unreachable, timed out, or refusing: gone for our purposes
                lost[r] = f"no answer to a control call within {timeout_s:g}s: {result}"
        return lost

    def kill(self, ranks: Sequence[int]) -> None:
        """End these owners (their slots go back to the cluster) and their processes at once,
        frozen ones included (``driver/terminate.py``)."""
        for rank in ranks:
            ray.kill(self.actors[rank], no_restart=True)
            end_process(self.nodes[rank])

    def reform(self) -> bool:
        """Re-form the collective group as the next generation; returns whether every rank's
        model state is intact (no rank had begun its update)."""
        self.members.generation += 1
        generation, timeout = self.generation, self.spec.init_timeout_s
        consistent = self.fan.grpc(self.clients, "reform", lambda c, r: c.reform(generation, timeout_s=timeout))
        return all(consistent)

    # -- changing the size --------------------------------------------------------------------------------
    def peers(self, count: int) -> Peers | None:
        """Which peer keeps each of the first ``count`` owners' snapshots (another node when there
        is one) and whose each keeps, among the owners of one TP shard; None without peer
        redundancy."""
        if not self.spec.snapshot_every:
            return None
        return Peers.of(backup_peers([n.get("node_id", "") for n in self.nodes[:count]],
                                     tensor_parallel=self.tensor_parallel))

    def assign_peers(self, count: int | None = None, *, after_transfer: bool = False) -> list[int]:
        """Tell the first ``count`` owners (all) which peer keeps their snapshots. After a resize
        or restore (``after_transfer``: every transfer has ended) this also confirms the new
        layout's copies, which then replace the old layout's; a recovery meanwhile counts them."""
        count = len(self.clients) if count is None else count
        self._layout_unconfirmed = after_transfer
        peers = self.peers(count) or Peers.own(count)
        backup, ward = peers.backup, peers.ward
        timeout = self.spec.init_timeout_s
        self.fan.grpc(self.clients[:count], "set_peers",
                      lambda c, r: c.set_peers(backup[r], ward[r], timeout_s=timeout))
        self._layout_unconfirmed = False  # left set when a loss cut SetPeers short
        return list(backup)

    def resize(self, world_size: int) -> ResizeReport:
        """Continue with ``world_size`` owners: start the extra ones (growing), move every
        partition range whose owner changes directly between actors, stop the surplus ones
        (shrinking: their slots go back to the cluster). Returns what moved and how long it
        took. New owners of a transfer that fails are ended again."""
        old = self.world_size
        start = time.perf_counter()
        lost = self.find_lost(timeout_s=min(2.0, self.spec.health_timeout_s))
        if lost:  # every owner must take part in the transfer: recover first
            rank = min(lost)
            raise OwnerLostError(f"cannot resize: partition owner {self.where(rank)} is gone ({lost[rank]})", rank=rank)
        info = self.transfer_description(range(old), timeout_s=self.spec.init_timeout_s)
        if world_size > old:
            check_resources(world_size=world_size, use_gpu=self.spec.use_gpu,
                            num_cpus_per_owner=self.spec.num_cpus_per_owner)
            room = self.free_slots()
            if room < world_size - old:
                raise ResourceError(f"growing to {world_size} owners needs {world_size - old} more slots of "
                                    f"{self.spec.demand} but the cluster has {room} free, counting "
                                    f"{self.replacements.slots} held by replacements starting "
                                    f"({ray.available_resources()})")
            self._start_owners(range(old, world_size), world_size=world_size)
        else:
            self.replacements.discard()
        self.members.generation += 1
        generation, timeout = self.generation, self.spec.init_timeout_s + self.spec.collective_timeout_s
        if world_size < old:
            # The survivors form a group of their own after the transfer (generation + 1): an
            # abort names that one, so it reaches an owner forming it as well as one still in the
            # transfer's group (an owner aborts its group for any generation at or past it).
            self.members.generation += 1
        peers = self.peers(world_size)  # the new layout's copies are made inside the transfer
        description = ReshardPlan(description=info, peers=peers).to_data()
        try:
            sent = self.fan.grpc(self.clients, "reshard", lambda c, r: c.reshard(
                old_world=old, new_world=world_size, generation=generation, description=description,
                timeout_s=timeout))
        except BaseException:
            if world_size > old:  # the owners this resize added hold nothing: end them
                self.remove(range(old, self.world_size))
            raise
        if peers:  # confirmed before the surplus owners (holding old-layout copies) leave
            self.assign_peers(world_size, after_transfer=True)
        if world_size < old:
            self.remove(range(world_size, old), close=True)
        return ResizeReport(previous_world_size=old, world_size=world_size, bytes_sent=sum(sent),
                            seconds=time.perf_counter() - start)

    def transfer_description(self, ranks: Sequence[int], *, timeout_s: float) -> TransferDescription:
        """What ``ranks``' owners hold, merged: the layout and state table a transfer moves."""
        return TransferDescription.merged(self.fan.grpc(
            [self.clients[r] for r in ranks], "resize_info",
            lambda c, i: TransferDescription.from_data(c.resize_info(timeout_s=timeout_s)), watch=False,
            ranks=list(ranks)))

    def statuses(self, ranks: Sequence[int], *, timeout_s: float) -> list[OwnerStatus]:
        """Where each of ``ranks``' owners stands (its finished step, its phase), in that order."""
        return self.fan.grpc([self.clients[r] for r in ranks], "status", lambda c, i: c.status(timeout_s=timeout_s),
                             watch=False, ranks=list(ranks))

    def remove(self, ranks: range, *, close: bool = False) -> None:
        """End the owners of ``ranks`` (the last ones) and forget them."""
        surplus, clients = self.actors[ranks.start:], self.clients[ranks.start:]
        del self.actors[ranks.start:], self.clients[ranks.start:], self.nodes[ranks.start:]
        self._membership_changed()  # before they stop, so their ending streams are not losses
        if close:
            self._close_owners(dict(enumerate(clients, start=ranks.start)), timeout_s=30.0)
        for actor in surplus:
            ray.kill(actor, no_restart=True)
        for client in clients:
            client.close()

    def snapshot_info(self, ranks: Sequence[int], committed_step: int) -> dict[int, dict[int, SnapshotRecord]]:
        """Per surviving rank: the committed snapshots it holds (by the rank they belong to)."""
        timeout = self.spec.settle_timeout_s + 30
        complete = self._layout_unconfirmed
        infos = self.fan.grpc([self.clients[r] for r in ranks], "snapshots",
                              lambda c, i: {int(r): SnapshotRecord.from_data(d) for r, d in c.snapshots(
                                  committed_step, layout_complete=complete, timeout_s=timeout).items()},
                              watch=False, ranks=ranks)
        return dict(zip(ranks, infos))

    def rebuild(self, survivors: Sequence[int], world_size: int, *,
                restore: Callable[[dict[int, int]], RestorePlan | None]) -> int:
        """Continue with the ``survivors`` (old ranks, keeping their order) plus new owners up to
        ``world_size``; ``restore(position_of_old_rank)`` gives the snapshot transfer (or None for
        fresh state, a checkpoint being loaded next). Returns bytes sent."""
        position = {old: new for new, old in enumerate(survivors)}
        added = range(len(survivors), world_size)
        if added and self.free_slots() < len(added):
            raise ResourceError(f"no room for {len(added)} replacements of {self.spec.demand} "
                                f"(free: {ray.available_resources()})")
        keep = set(survivors)
        for r, client in enumerate(self.clients):
            if r not in keep:
                client.close()
        self.actors = [self.actors[r] for r in survivors]
        self.members.nodes = [self.nodes[r] for r in survivors]
        self.members.clients = [self.clients[r] for r in survivors]
        self.members.generation += 1
        if added:
            self._start_owners(added, world_size=world_size)
        else:
            self.replacements.discard()  # started for the pool before this loss
            self._membership_changed()
        plan = restore(position)
        peers = self.peers(world_size)
        if plan is not None and peers:  # the restored layout's copies are made inside the transfer
            plan = dataclasses.replace(plan, peers=peers)
        generation, timeout = self.generation, self.spec.init_timeout_s + self.spec.collective_timeout_s
        data = restore_to_data(plan)
        sent = self.fan.grpc(self.clients, "rebuild", lambda c, p: c.rebuild(
            position=p, world_size=world_size, generation=generation, restore=data, timeout_s=timeout))
        if self.spec.snapshot_every:
            self.assign_peers(after_transfer=plan is not None)
        return sum(sent)

    # -- the end ----------------------------------------------------------------------------------------
    def _close_owners(self, targets: dict[int, OwnerClient], *, timeout_s: float) -> None:
        """Have these owners leave their group and stop serving; they are killed next either way
        (an owner stuck in a collective cannot close)."""
        got = self.fan.urgent(targets, lambda c: c.close_owner(timeout_s=timeout_s), timeout_s=timeout_s)
        for rank, result in got.items():
            if isinstance(result, Exception):
                log.debug("owner %d did not close cleanly: %s", rank, result)

    def shutdown(self) -> None:
        """Stop the owners (their slots go back to the cluster)."""
        if self.health is not None:
            self.health.close()
        self.replacements.discard()
        lost = self._lost()
        self._close_owners({r: c for r, c in enumerate(self.clients) if r not in lost}, timeout_s=10.0)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        for client in self.clients:
            client.close()
        self.members.clients = []
        self.relays.close()
        self._relayed = False
        self.fan.close()
