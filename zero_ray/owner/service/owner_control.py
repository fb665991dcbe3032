"""OwnerControl: the partition owner's side of the gRPC control plane, which carries every
control operation on a live owner (Ray only creates and kills it and carries its data).

The server runs on its own thread pool, so ``abort`` and ``heartbeat`` are served while the
actor's compute thread is blocked inside a collective. The handler is given the rank's live
state (``LiveRank``, owner/service/live_rank.py), whose membership operations (setup, reform,
reshard, rebuild, snapshots) it runs on a server thread, and the server serving it (its address
for Status; Close stops it). A failure is reported with the owner's rank and step phase
(``failure_context``): the server sends them in the call's FailureDetail beside the exception's
type, message and traceback.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass

from zero_ray.collective.flight_recorder import Event
from zero_ray.control import handlers as h
from zero_ray.control.server import ControlServer
from zero_ray.core.stall_diagnosis import IDLE
from zero_ray.core.run_position import Position
from zero_ray.core.restore_plan import reshard_from_data, restore_from_data
from zero_ray.errors import CheckpointError, CollectiveError
from zero_ray.owner.resilience.checkpointing import restore, shard_record_json
from zero_ray.owner.service.live_rank import LiveRank
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.service.step_order import StepOrder


@dataclass(frozen=True, kw_only=True)
class OwnerPlace:
    """Where an owner's process runs (the actor asks Ray once, as it starts)."""

    node_id: str
    host: str
    ip: str
    pid: int


class DriverContact:
    """When a driver was last in touch with this owner: any control call, a heartbeat served (a
    detached owner that no driver reaches for ``orphan_timeout_s`` ends itself); and whether one
    has taken it into its pool yet (``standby``: an owner started ahead of a grow is not a member
    until the grow's first membership operation reaches it, so an attaching driver ends it)."""

    def __init__(self, *, standby: bool = False) -> None:
        self.last = time.monotonic()
        self.standby = standby

    def touch(self) -> None:
        self.last = time.monotonic()

    def take_in(self) -> None:
        """A membership operation (Setup, Reshard, Rebuild) made this owner a member of a pool."""
        self.standby = False
        self.touch()


def layout_of(engine: OwnerEngine) -> h.ModelLayout:
    """The model as ``engine`` laid it out: the one description of it, in the Setup reply and in
    Status (the driver builds its own view from this record, ``driver/pool.ModelView``)."""
    layout, trainable = engine.layout, engine.state.trainable
    return h.ModelLayout(numel=layout.numel, padded_numel=layout.padded_numel, buckets=len(layout.buckets),
                         params=tuple(h.ParamInfo(name=p.name, shape=tuple(p.shape), trainable=trainable[p.index])
                                      for p in layout.params))


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class OwnerControl:
    """Implements ``zero_ray.control.handlers.OwnerHandler`` for one partition owner."""

    def __init__(self, owner: LiveRank, *, contact: DriverContact, server: ControlServer, place: OwnerPlace,
                 detached: bool, fetch_timeout_s: float, save_timeout_s: float, ahead_timeout_s: float) -> None:
        self._owner = owner  # the rank's live state and membership operations
        self._contact = contact  # touched by every call from a driver
        self._server = server  # the one serving this handler: its address, stopped by close()
        self._place = place
        self._detached = detached
        self._fetch_timeout_s = fetch_timeout_s
        self._save_timeout_s = save_timeout_s
        self._ahead_timeout_s = ahead_timeout_s  # the longest a step sent ahead waits for the one before
        self._lock = owner.step_lock  # one step at a time, whatever the driver sends
        self._order = StepOrder()

    def step(self, args: h.StepArgs) -> h.StepResult:
        owner = self._owner
        self._contact.touch()
        self._check_generation(args.generation, "step")
        if args.ahead:  # sent while the step before may still run: after it, and only if it completed
            self._order.wait_for_previous(rank=owner.rank, generation=args.generation, step=args.step,
                                          timeout_s=self._ahead_timeout_s)
        with self._lock:
            self._check_generation(args.generation, "step")
            # The driver saw every rank finish the step before (two before, for one sent ahead).
            if owner.snapshots.pending is not None:
                owner.snapshots.commit_upto(args.step - (2 if args.ahead else 1))
            completed = False
            try:
                started = time.perf_counter()
                owner.flight.phase(f"waiting for data (step {args.step + 1})")
                try:
                    piece = owner.data.take(args.piece, timeout_s=self._fetch_timeout_s,
                                            generation=args.generation, step=args.step)
                    waited = time.perf_counter() - started
                    result = owner.engine.step(piece, global_samples=args.global_samples,
                                               position=Position(step=args.step, samples_seen=args.samples_seen))
                finally:  # a step that raised is over here: idle, not "in compute", to a stall diagnosis
                    owner.flight.phase(IDLE)
                result = dataclasses.replace(result, data_seconds=waited)
                if not result.refused:  # a refused step changed nothing: no snapshot is due
                    if owner.snapshot_every:  # peer redundancy on: a snapshot may be due
                        owner.after_step(args.step)
                    completed = True
            finally:
                self._order.ended(generation=args.generation, step=args.step, completed=completed)
        return result

    def evaluate(self, args: h.EvaluateArgs) -> h.EvaluateResult:
        owner = self._owner
        self._check_generation(args.generation, "evaluate")
        with self._lock:
            piece = owner.data.take(args.piece, timeout_s=self._fetch_timeout_s, generation=args.generation)
            totals = owner.engine.evaluate(piece)
        return h.EvaluateResult(totals=totals, rank=owner.rank)

    def _check_generation(self, generation: int, what: str) -> None:
        owner = self._owner
        if generation != owner.generation:
            raise CollectiveError(f"{what} of generation {generation} sent to rank {owner.rank}, "
                                  f"which is at generation {owner.generation}")

    def save(self, path: str, step: int, phase: h.SavePhase) -> h.SaveResult:
        try:
            return self._save(path, step, phase)
        except TimeoutError:
            raise  # a writer that hangs is the owner's trouble, as before (TimeoutError is an OSError)
        except OSError as err:
            # The storage refused (a full disk, no permission, the store's errors): a CheckpointError,
            # which the driver's policy does not recover from (nothing on the owners changed), so
            # the save is abandoned and the run goes on, instead of re-forming a healthy group.
            raise CheckpointError(f"rank {self._owner.rank} could not write its checkpoint file under {path}: "
                                  f"{type(err).__name__}: {err}; free room on that storage or save elsewhere"
                                  ) from err

    def _save(self, path: str, step: int, phase: h.SavePhase) -> h.SaveResult:
        owner = self._owner
        written = 0
        if phase is not h.SavePhase.AWAIT:
            with self._lock:  # a consistent snapshot: never in the middle of a step
                owner.flight.phase(f"checkpoint (snapshot of step {step})")
                try:
                    written = owner.saver.start(owner.engine, path)
                finally:
                    owner.flight.phase(IDLE)
        if phase is h.SavePhase.SNAPSHOT:
            return h.SaveResult(path=path, step=step, bytes_written=written)
        record, model = owner.saver.wait(path, timeout_s=self._save_timeout_s)
        return h.SaveResult(path=f"{path}/{record.name}" if record else path, step=step,
                            bytes_written=record.size if record else 0,  # None: another shard group wrote it
                            # every rank knows the optimizer state entries of what it updates
                            record_json=shard_record_json(record, model if owner.rank == 0
                                                          else {"param_state": model["param_state"]}))

    def load(self, path: str, step: int) -> h.LoadResult:
        owner = self._owner
        with self._lock:
            read = restore(owner.engine, path)
        return h.LoadResult(step=owner.engine.position.step, bytes_read=read)

    def abort(self, reason: str, generation: int) -> bool:
        # A step waiting for a staged piece that will never come (its staging failed) gives up too,
        # as does one sent ahead waiting for the step before it.
        self._owner.data.abort(generation)
        self._order.interrupt(generation)
        return self._owner.abort(reason=reason, generation=generation)

    def heartbeat(self) -> h.Heartbeat:
        owner = self._owner
        self._contact.touch()
        engine = owner.engine_or_none
        return h.Heartbeat(rank=owner.rank, step=engine.position.step if engine else 0,
                           state=engine.phase.value if engine else "starting", timestamp=time.time(),
                           rss_bytes=rss_bytes())

    def stats(self) -> h.OwnerStats:
        owner = self._owner
        engine = owner.engine_or_none
        if engine is None:  # between setups (a resize or restore in progress): alive, holding nothing
            return h.OwnerStats(step=0, rank=owner.rank, world_size=owner.world_size, stage=0, memory_bytes={},
                                bytes_sent={})
        memory = {k: v for k, v in engine.memory_report().items() if k != "rank"}
        on_disk = owner.snapshots.file_bytes(engine.state.state_files)  # offloaded: the copies are files too
        memory["redundancy_host"] = owner.snapshots.nbytes - on_disk  # peer snapshots in host memory
        memory["redundancy_nvme"] = on_disk
        split = engine.fabric.split(engine.last_peers)  # by the node each message went to
        return h.OwnerStats(step=engine.position.step, rank=owner.rank, world_size=owner.world_size,
                            stage=engine.spec.plan.stage, memory_bytes=memory, bytes_sent=dict(engine.last_bytes),
                            inside_node_bytes=split["inside_node"], cross_node_bytes=split["cross_node"])

    # -- membership: the actor's own operations, served here ------------------------------------------
    def setup(self) -> h.SetupResult:
        owner = self._owner
        self._contact.take_in()
        owner.setup()
        return h.SetupResult(rank=owner.rank, layout=layout_of(owner.engine))

    def reform(self, generation: int) -> bool:
        self._contact.touch()
        return self._owner.reform(generation)

    def set_peers(self, backup: int, ward: int) -> None:
        self._contact.touch()
        self._owner.set_peers(backup, ward)

    def snapshots(self, committed_step: int, layout_complete: bool) -> h.Plain:
        self._contact.touch()
        held = self._owner.snapshot_info(committed_step, layout_complete=layout_complete)
        return {rank: record.to_data() for rank, record in held.items()}

    def resize_info(self) -> h.Plain:
        self._contact.touch()
        return self._owner.resize_info().to_data()

    def reshard(self, *, old_world: int, new_world: int, generation: int, description: h.Plain) -> int:
        self._contact.take_in()
        return self._owner.reshard(old_world=old_world, new_world=new_world, generation=generation,
                                   plan=reshard_from_data(description))

    def rebuild(self, *, position: int, world_size: int, generation: int, restore: h.Plain | None) -> int:
        self._contact.take_in()
        return self._owner.rebuild(position=position, world_size=world_size, generation=generation,
                                   restore=restore_from_data(restore))

    def flight(self) -> h.Flight:
        # Not a driver's contact either: read by a driver diagnosing a stall and by operators.
        owner = self._owner
        snap = owner.flight.snapshot()

        def event(e: Event) -> h.CollectiveEvent:
            return h.CollectiveEvent(op=e.op, group=e.group, seq=e.seq, nbytes=e.nbytes, started=e.started,
                                     ended=e.ended)

        return h.Flight(rank=owner.rank, phase=snap.phase, phase_since=snap.phase_since, now=snap.now,
                        current=event(snap.current) if snap.current else None,
                        recent=tuple(event(e) for e in snap.recent))

    def status(self) -> h.OwnerStatus:
        """Where this owner stands, for ``ZeroTrainer.attach`` and ``zero-ray status``: ``step``
        and ``samples_seen`` are the run's position as the driver last set it here (steps
        completed and their samples); no layout before the owner has model state."""
        # Not a driver's contact: `zero-ray status` listing an orphaned run must not keep it alive.
        owner, place = self._owner, self._place
        engine = owner.engine_or_none
        position = engine.position if engine else Position()
        return h.OwnerStatus(rank=owner.rank, world_size=owner.world_size, generation=owner.generation,
                             step=position.step, samples_seen=position.samples_seen,
                             phase=engine.phase.value if engine else "starting", busy=owner.step_lock.locked(),
                             detached=self._detached, node_id=place.node_id, host=place.host, ip=place.ip,
                             pid=place.pid, control_address=self._server.address,
                             layout=layout_of(engine) if engine else None, standby=self._contact.standby)

    def close(self) -> None:
        self._owner.release()
        # Stopping the server waits for the calls in flight, this one included: do it after replying.
        threading.Thread(target=self._stop, name="zero_ray-close", daemon=True).start()

    def _stop(self) -> None:
        """Stop serving and leave the collective group so the process can exit cleanly."""
        self._server.stop(grace_s=0.5)
        self._owner.release()

    def failure_context(self) -> h.FailureContext:
        owner = self._owner
        engine = owner.engine_or_none
        return h.FailureContext(rank=owner.rank, phase=engine.phase.value if engine is not None else "starting")
