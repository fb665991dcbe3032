"""OwnerControl: the partition owner's side of the gRPC control plane.

The server runs on its own thread pool, so ``abort`` and ``heartbeat`` are served while the
actor's compute thread is blocked inside a collective.
"""

from __future__ import annotations

import os
import time
import traceback
import threading
from typing import Protocol

from zero_ray.control import handlers as h
from zero_ray.core.position import Position
from zero_ray.errors import CollectiveError, domain_error
from zero_ray.owner.checkpointing import ShardSaver, restore, shard_record_json
from zero_ray.owner.data import PieceSource
from zero_ray.owner.engine import OwnerEngine
from zero_ray.owner.redundancy import PeerSnapshots


class OwnerHost(Protocol):
    """What the control handler needs of the actor that serves it (``PartitionOwner``)."""

    rank: int
    world_size: int
    generation: int
    saver: ShardSaver
    snapshots: PeerSnapshots
    data: PieceSource
    step_lock: threading.Lock

    @property
    def engine(self) -> OwnerEngine: ...

    @property
    def engine_or_none(self) -> OwnerEngine | None: ...

    def abort(self, *, reason: str, generation: int) -> bool: ...

    def after_step(self, step: int) -> None: ...

    def touch(self) -> None: ...


def _with_traceback(err: Exception, rank: int) -> Exception:
    """The same domain error (or an OwnerError) with the remote traceback appended, since only
    the status message crosses gRPC. The message comes first: long details are cut at the end."""
    tb = traceback.format_exc()
    tb = tb if len(tb) <= 2500 else "...\n" + tb[-2500:]
    text = f"{err}\n\nRemote traceback (rank {rank}):\n{tb}"
    return domain_error(type(err), text, rank=rank, fallback=f"{type(err).__name__}: {text}")


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class OwnerControl:
    """Implements ``zero_ray.control.handlers.OwnerHandler`` for one partition owner."""

    def __init__(self, owner: OwnerHost, *, fetch_timeout_s: float, save_timeout_s: float) -> None:
        self._owner = owner
        self._fetch_timeout_s = fetch_timeout_s
        self._save_timeout_s = save_timeout_s
        self._lock = owner.step_lock  # one step at a time, whatever the driver sends

    def step(self, args: h.StepArgs) -> h.StepResult:
        owner = self._owner
        owner.touch()
        self._check_generation(args.generation, "step")
        with self._lock:
            try:
                owner.snapshots.commit_upto(args.step - 1)  # the driver saw every rank finish that step
                piece = owner.data.take(args.piece, timeout_s=self._fetch_timeout_s)
                result = owner.engine.step(piece, global_samples=args.global_samples,
                                           position=Position(step=args.step, samples_seen=args.samples_seen))
                if not result.refused:  # a refused step changed nothing: no snapshot is due
                    owner.after_step(args.step)
            except Exception as err:
                raise _with_traceback(err, owner.rank) from err
        return result

    def evaluate(self, args: h.EvaluateArgs) -> h.EvaluateResult:
        owner = self._owner
        self._check_generation(args.generation, "evaluate")
        with self._lock:
            try:
                piece = owner.data.take(args.piece, timeout_s=self._fetch_timeout_s)
                totals = owner.engine.evaluate(piece)
            except Exception as err:
                raise _with_traceback(err, owner.rank) from err
        return h.EvaluateResult(totals=totals, rank=owner.rank)

    def _check_generation(self, generation: int, what: str) -> None:
        owner = self._owner
        if generation != owner.generation:
            raise CollectiveError(f"{what} of generation {generation} sent to rank {owner.rank}, "
                                  f"which is at generation {owner.generation}")

    def save(self, path: str, step: int, phase: h.SavePhase) -> h.SaveResult:
        owner = self._owner
        written = 0
        try:
            if phase is not h.SavePhase.AWAIT:
                with self._lock:  # a consistent snapshot: never in the middle of a step
                    written = owner.saver.start(owner.engine, path)
            if phase is h.SavePhase.SNAPSHOT:
                return h.SaveResult(path=path, step=step, bytes_written=written)
            record, model = owner.saver.wait(path, timeout_s=self._save_timeout_s)
        except Exception as err:
            raise _with_traceback(err, owner.rank) from err
        return h.SaveResult(path=f"{path}/{record.name}", step=step, bytes_written=record.size,
                            # every rank knows the optimizer state entries of what it updates
                            record_json=shard_record_json(record, model if owner.rank == 0
                                                          else {"param_state": model["param_state"]}))

    def load(self, path: str, step: int) -> h.LoadResult:
        owner = self._owner
        with self._lock:
            try:
                read = restore(owner.engine, path)
            except Exception as err:
                raise _with_traceback(err, owner.rank) from err
        return h.LoadResult(step=owner.engine.position.step, bytes_read=read)

    def abort(self, reason: str, generation: int) -> bool:
        return self._owner.abort(reason=reason, generation=generation)

    def heartbeat(self) -> h.Heartbeat:
        owner = self._owner
        owner.touch()
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
        return h.OwnerStats(step=engine.position.step, rank=owner.rank, world_size=owner.world_size,
                            stage=engine.spec.plan.stage, memory_bytes=memory, bytes_sent=dict(engine.last_bytes))
