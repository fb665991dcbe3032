"""LiveRank: one rank's live state (its place in the pool, its collective group and its
OwnerEngine, the peer snapshots it holds, the pieces staged for it) and the membership
operations that change it: setup, abort, re-forming the group, a rebuild after a loss, a live
reshard, peer snapshots after a step.

The actor (``owner/service/actor.py``) holds one and gives it to its control handler
(``owner/service/owner_control.py``), which serves these operations on the server's threads.
Membership operations (re-forming the group, a live reshard, a rebuild after a loss) run under
the step lock and can be aborted like a step: ``abort`` tears down the group of its generation,
and an abort for a generation the owner has not reached yet is remembered, so the owner refuses
to join it. After an abort, an operation that waits for the lock gives up after
``settle_timeout_s``: an owner still stuck inside the aborted operation is reported, and the
driver treats it as lost rather than wait out ``collective_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from zero_ray.collective.flight_recorder import FlightRecorder, RecordedGroup
from zero_ray.collective.collective_api import Collective
from zero_ray.collective.ray_group import destroy_group, form_group
from zero_ray.core.restore_plan import Peers, ReplicaRestore, ReshardPlan, RestorePlan, SnapshotRecord, TransferDescription
from zero_ray.errors import CollectiveError, OwnerError
from zero_ray.owner.resilience.checkpointing import ShardSaver
from zero_ray.owner.resilience.redundancy import PeerSnapshots, restore_from_peers
from zero_ray.owner.resilience.replica_transfer import live_state, restore_replica
from zero_ray.owner.resilience.resize import RankState, TransferPlan, exchange, install
from zero_ray.owner.service.batch_source import PieceSource
from zero_ray.owner.service.device import setup_device
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.step.rank_collectives import exchange_nodes
from zero_ray.owner.step.run_spec import EngineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """How a rank forms and keeps its collective groups (the actor's ``OwnerOptions``)."""

    backend: str
    group_prefix: str
    collective_timeout_s: float
    settle_timeout_s: float  # after an abort: how long an operation waits for the aborted one to end
    snapshot_every: int  # peer snapshots every this many steps; 0: no in-memory redundancy


class LiveRank:
    """One rank's place in the pool, its group, its OwnerEngine and what changes them."""

    def __init__(self, *, rank: int, world_size: int, spec: EngineSpec, settings: GroupSettings) -> None:
        self.rank = rank
        self.world_size = world_size
        self.generation = 0
        self._spec = spec
        self._settings = settings
        self.snapshot_every: int = settings.snapshot_every  # 0: after_step has nothing to do
        self._engine: OwnerEngine | None = None
        self._group: Collective | None = None
        self._device_ready = False  # setup_device() has checked the device and made it current
        self.saver = ShardSaver()
        self.snapshots = PeerSnapshots()
        self.data = PieceSource()
        self.flight = FlightRecorder()  # this process's collectives and phase, across groups and engines
        self.backup = self.ward = rank  # peers for snapshots, set by the driver
        self.step_lock = threading.Lock()  # held by a step; recovery waits for it
        self._aborted = -1  # the newest generation an abort was asked for
        self._forming: threading.Event | None = None  # set to abort the group formation in progress
        self._teardown: threading.Thread | None = None  # an abort's teardown of the last group, on its own thread
        self._torn: Collective | None = None  # the group that teardown is of
        self._abort_lock = threading.Lock()

    def _group_name(self) -> str:
        return f"{self._settings.group_prefix}-g{self.generation}"

    def _join(self) -> Collective:
        if self._aborted >= self.generation:
            raise CollectiveError(f"rank {self.rank}: generation {self.generation} was aborted before it formed")
        o = self._settings
        teardown = self._teardown
        if teardown is not None:
            # An abort's teardown ends torch's default group and resets its group counter: run
            # alongside this formation, it hit the new group (a Reform 0.5 s after the Abort failed
            # with torch's "group name has already been created", test_control, once under load).
            teardown.join(timeout=o.settle_timeout_s)
            if teardown.is_alive():
                raise CollectiveError(f"rank {self.rank}: the last group's teardown did not end within "
                                      f"settle_timeout_s={o.settle_timeout_s:g}s; generation {self.generation} "
                                      "cannot form beside it")
            self._teardown = self._torn = None
        if not self._device_ready:  # before any group: NCCL forms on the current device
            setup_device(device=self._spec.device, backend=o.backend, rank=self.rank)
            self._device_ready = True
        # An abort of this generation (another thread: a peer was lost before it arrived) ends
        # the formation at once instead of leaving this rank stuck in it until the timeout.
        forming = self._forming = threading.Event()
        if self._aborted >= self.generation:  # an abort raced in before the event existed
            forming.set()
        try:
            name = self._group_name()
            self._group = RecordedGroup(form_group(backend=o.backend, group_name=name, rank=self.rank,
                                                   world_size=self.world_size, timeout_s=o.collective_timeout_s,
                                                   abort=forming), self.flight, name=name)
        finally:
            self._forming = None
        return self._group

    def _new_engine(self, group: Collective) -> OwnerEngine:
        # Where Ray placed every rank (one scalar all-reduce): the Topology's groups follow the nodes.
        nodes = exchange_nodes(group, ray.get_runtime_context().get_node_id())
        return OwnerEngine(self._spec, rank=self.rank, group=group, nodes=nodes, flight=self.flight)

    def setup(self) -> None:
        """Join the group (all ranks concurrently) and build the model state."""
        self._engine = self._new_engine(self._join())

    @property
    def engine(self) -> OwnerEngine:
        if self._engine is None:
            raise RuntimeError("setup() has not run on this owner")
        return self._engine

    @property
    def engine_or_none(self) -> OwnerEngine | None:
        return self._engine

    def abort(self, *, reason: str, generation: int) -> bool:
        """Tear down this owner's group when ``generation`` is its own or a later one (a shrink's
        abort names the survivors' next group while some are still in the transfer's), so that
        collectives blocked on it fail (called from a gRPC thread); remember an abort of a
        generation not yet reached, so that it is never joined. An abort of an older generation
        changes nothing. Returns whether a step was in flight."""
        self._aborted = max(self._aborted, generation)
        forming = self._forming
        if forming is not None and generation >= self.generation:
            log.warning("rank %d aborting the formation of generation %d: %s", self.rank, self.generation, reason)
            forming.set()
            return True
        group = self._group
        if generation < self.generation or group is None:
            return False
        busy = self._engine is not None and self._engine.phase.value != "idle"
        with self._abort_lock:  # two aborts may arrive at once, on two gRPC threads
            if self._torn is group:
                # Its teardown is under way or done: a second abort (the driver's direct one after
                # the tree's call to this rank's subtree outlived its deadline) changes nothing, and
                # a second teardown thread would replace the one the next formation waits for.
                return busy
            self._torn = group
            # Tearing down may block while this rank's own compute thread waits inside the group;
            # the point is to close its sockets for the peers, so do it without holding the caller.
            teardown = self._teardown = threading.Thread(target=group.abort, name="zero_ray-abort", daemon=True)
        log.warning("rank %d aborting generation %d: %s", self.rank, generation, reason)
        teardown.start()
        return busy

    def reform(self, generation: int) -> bool:
        """Leave the current group and join ``generation``'s (all ranks concurrently); forget
        the interrupted step. Returns whether the model state is still consistent."""
        if self._group is not None:
            self._group.abort()
        with self._locked("re-form", settle=True):
            self.data.drop_staged()
            self.generation = generation
            consistent = self.engine.discard_step()
            self.snapshots.drop_pending()
            self.engine.rebind(self._join())
        return consistent

    # -- in-memory redundancy ------------------------------------------------------------------------
    def set_peers(self, backup: int, ward: int) -> None:
        """This rank sends its snapshots to ``backup`` and keeps ``ward``'s. After a resize or a
        restore (the driver calls this once every rank's transfer ended) the new layout's copies
        become the committed ones."""
        self.backup, self.ward = backup, ward
        self.snapshots.confirm_layout(backup, ward)

    def after_step(self, step: int) -> None:
        """End of driver step ``step`` on the compute thread: take a peer snapshot when due. The
        step counts as updating until it is done, so an interrupted snapshot is restored, never
        retried on top of the update."""
        every = self.snapshot_every
        if every and (step + 1) % every == 0 and self._group is not None:
            engine = self.engine
            with engine.updating():
                self.snapshots.take(engine, self._group, step=step, backup=self.backup, ward=self.ward,
                                    timeout_s=self._settings.collective_timeout_s)

    def snapshot_info(self, committed_step: int, *, layout_complete: bool = False) -> dict[int, SnapshotRecord]:
        """The committed snapshots held (by rank), once the driver says ``committed_step`` was
        finished everywhere; a pending snapshot of a later, interrupted step is dropped."""
        with self._locked("snapshot_info", settle=True):
            self.snapshots.commit_upto(committed_step)
            self.snapshots.drop_pending()
            # Unconfirmed copies of a new layout: kept when every rank's transfer ended (SetPeers
            # was cut short), dropped when the resize or restore itself did not complete.
            peers = self.snapshots.settle_layout(complete=layout_complete)
            if peers is not None:
                self.backup, self.ward = peers
            return self.snapshots.info()

    @contextmanager
    def _locked(self, what: str, *, settle: bool = False) -> Iterator[None]:
        """The step lock, waiting (bounded) for an aborted operation's thread to give up: up to
        ``settle_timeout_s`` after an abort (``settle``), else ``collective_timeout_s``."""
        o = self._settings
        timeout = o.settle_timeout_s if settle else o.collective_timeout_s
        if not self.step_lock.acquire(timeout=timeout):
            # An OwnerError names this owner, so the driver treats it as lost rather than wait on.
            raise OwnerError(f"rank {self.rank}: the interrupted operation did not end within {timeout:g}s "
                             f"after the abort (stuck, e.g. in forming a group); cannot {what}", rank=self.rank)
        try:
            yield
        finally:
            self.step_lock.release()

    def rebuild(self, *, position: int, world_size: int, generation: int, restore: RestorePlan | None) -> int:
        """Take rank ``position`` of a new ``world_size``-rank pool after a loss. With a
        ``PeerRestore``: move every old rank's snapshot from the actor holding it to the ranks
        that now own its ranges (``restore.holders[i]`` is the position holding old rank i) and
        install them; with a ``ReplicaRestore``: take a surviving shard group's live state;
        without, build fresh state (a checkpoint is loaded next). Returns bytes sent."""
        if self._group is not None:  # first: a step blocked on it then fails and lets go of the lock
            self._group.abort()
            self._group = None
        with self._locked("rebuild", settle=True):
            self.data.drop_staged()
            if isinstance(restore, ReplicaRestore):  # a surviving shard group's live state (core/replica_plan.py)
                sources = live_state(self._engine, restore)
            else:
                sources = ({r: s.state for r, s in self.snapshots.sources().items()} if restore is not None else {})
            self._engine = None
            self.rank, self.world_size, self.generation = position, world_size, generation
            group = self._join()
            sent, staged, plan = 0, None, None
            if isinstance(restore, ReplicaRestore):
                plan, staged, sent = restore_replica(restore, me=position, sources=sources, group=group,
                                                     timeout_s=self._settings.collective_timeout_s)
            elif restore is not None:
                plan, staged, sent = restore_from_peers(restore, position=position, world_size=world_size,
                                                        tensor_parallel=self._spec.tensor_parallel.size,
                                                        sources=sources, group=group,
                                                        timeout_s=self._settings.collective_timeout_s)
            engine = self._new_engine(group)
            if staged is not None and plan is not None and restore is not None:
                install(staged, engine.state, plan.table)
                engine.set_counters(restore.description.counters)
                engine.state.publish_masters()
            self._engine = engine
            if restore is None:  # fresh state, a checkpoint loaded next: no copies to keep
                self.snapshots = PeerSnapshots()
            # Else the old layout's copies stay until the driver confirms the new layout's: a
            # rebuild cut short by another loss (even after this rank's transfers finished) is
            # tried again from them.
            self._copy_layout(engine, group, restore.peers if restore is not None else None)
            return sent

    def _copy_layout(self, engine: OwnerEngine, group: Collective, peers: Peers | None) -> None:
        """Send the layout just installed to this rank's new backup (``peers``: every rank's,
        the same on all), so that no partition has its only copy here once the old layout's
        copies go (``set_peers`` confirms)."""
        if not peers or not self._settings.snapshot_every:
            return
        me = engine.rank
        with engine.updating():
            self.snapshots.take_layout(engine, group, step=engine.position.step - 1, backup=peers.backup[me],
                                       ward=peers.ward[me], timeout_s=self._settings.collective_timeout_s)

    def resize_info(self) -> TransferDescription:
        """This rank's part of what every actor of a resize needs (the driver merges every
        rank's: each knows the optimizer state entries of what it updates)."""
        return self.engine.transfer_description()

    def reshard(self, *, old_world: int, new_world: int, generation: int, plan: ReshardPlan) -> int:
        """Move this actor's part of the model state from the ``old_world`` layout to the
        ``new_world`` one (every actor of either calls this concurrently; see owner/resilience/resize.py).
        Returns bytes sent. Afterwards a surplus actor (index >= new_world) holds nothing."""
        with self._locked("reshard"):  # a recovery after a failed transfer waits for it to give up
            self.data.drop_staged()
            if self._engine is not None:  # the driver saw every rank finish the last step
                self.snapshots.commit_upto(self._engine.position.step - 1)
            try:
                return self._reshard(old_world=old_world, new_world=new_world, generation=generation, reshard=plan)
            except BaseException:
                self.world_size = old_world  # the old layout's state (if any) stays; a recovery decides
                self.snapshots.drop_layout()
                raise

    def _reshard(self, *, old_world: int, new_world: int, generation: int, reshard: ReshardPlan) -> int:
        me = self.rank
        info = reshard.description
        # With tensor parallelism each TP shard's data-parallel group reshards on its own: TP rank
        # t of data-parallel rank d is actor d T + t in both layouts (a resize keeps T), so the
        # plan is over D ranks and its moves go between actors holding the same shard.
        tp = self._spec.tensor_parallel.size
        t, dp_me = me % tp, me // tp
        plan = TransferPlan.of(info, old_world=old_world // tp, new_world=new_world // tp)
        old = self._engine
        if self._group is not None:
            self._group.destroy()
            self._group = None
        self.generation, self.world_size = generation, max(old_world, new_world)
        transfer = self._join()
        staged = plan.staging(dp_me, new_world // tp) if me < new_world else None
        sources = ({dp_me: RankState(slices=old.state.optimizer_slices(),
                                     whole=old.state.optimizer.whole_state(saver_only=True))} if old is not None else {})
        sent = exchange(plan, me=me, sources=sources, senders=list(range(t, old_world, tp)), staged=staged,
                        group=transfer, timeout_s=self._settings.collective_timeout_s,
                        receivers=list(range(t, new_world, tp)))
        self._engine = old = None  # the old state is no longer needed: free it before building the new
        self.world_size = new_world
        if new_world != transfer.world_size:
            # A sender's isend completes once its bytes are handed to the socket: a leaving owner
            # closing the group then could reset a connection its receiver is still reading.
            transfer.barrier()
            transfer.destroy()
            self._group = None
            if me >= new_world:
                return sent
            self.generation = generation + 1  # the M-rank group gets a name of its own
            group = self._join()
        else:
            group = transfer
        engine = self._new_engine(group)
        assert staged is not None
        install(staged, engine.state, plan.table)
        engine.set_counters(info.counters)
        engine.state.publish_masters()
        self._engine = engine
        self._copy_layout(engine, group, reshard.peers)  # the old layout's copies stay until confirmed
        return sent


    def release(self) -> None:
        """Leave the collective group and stop the background writer (idempotent)."""
        self.saver.close()
        if self._engine is not None and self.world_size > 1:
            destroy_group(self._group_name())
        self._engine = None
