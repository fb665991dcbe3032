"""Checkpointer: the driver's side of a save — reserve the directory, have every owner snapshot
its slices, and commit in the background once every rank's file is durable.

Only the snapshot (each owner copying its slices to host memory) holds up training; the
owners write (or upload) their files on their own threads while the driver keeps stepping, and
this class's commit thread waits for all of them, writes the manifest and publishes the
directory. No tensor passes through the driver: owners are told where, as a string each opens
itself (``Storage.locate``). One save is in flight at a time: the next waits for the previous
commit.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import build_manifest, shard_file_from_data
from zero_ray.checkpoint.storage import Storage
from zero_ray.control.handlers import SavePhase
from zero_ray.core.run_position import Position
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CheckpointError, OwnerLostError, ZeroRayError

log = logging.getLogger(__name__)


class SaveState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"  # owners are writing their files; the commit thread waits for them
    FAILED = "failed"  # the last save was abandoned; its error is kept for wait()


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What the manifest records about the run besides the model state."""

    position: Position
    world_size: int
    stage: int
    training: dict[str, Any]  # zero_ray.config.training_record: the settings that change the math
    config: dict[str, Any]  # zero_ray.config_record.config_record: the whole ZeroConfig
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. fit()'s data order, to resume it

    @property
    def step(self) -> int:
        return self.position.step


class Checkpointer:
    """Saves of one run, at most one in flight."""

    def __init__(self, pool: OwnerPool, *, keep: int, timeout_s: float) -> None:
        self._pool = pool
        self._keep = keep
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.state = SaveState.IDLE
        self.last_committed: str | None = None
        self.last_root: str | None = None  # the root of last_committed, as Storage.locate names it
        self.last_error: BaseException | None = None

    def save(self, storage: Storage, root: str, record: RunRecord, *,
             on_commit: Callable[[str], None] | None = None, remember: bool = True) -> str:
        """Snapshot every owner now and commit under ``root`` (on ``storage``) in the background.
        Returns the directory the checkpoint will have once committed (``wait()`` blocks until
        then). ``remember=False``: a scratch save (an export) that never becomes
        ``last_committed``, the checkpoint recovery restores from."""
        self.wait(raise_error=False)
        lost = self._pool.find_lost(timeout_s=2.0)
        if lost:  # a checkpoint needs every partition
            rank = min(lost)
            raise OwnerLostError(f"cannot save: partition owner {self._pool.where(rank)} is gone ({lost[rank]})",
                                 rank=rank)
        pending = store.begin(root, record.step, storage=storage)
        where = storage.locate(pending.tmp)
        try:
            self._pool.save(where, record.step, phase=SavePhase.SNAPSHOT, timeout_s=self._timeout_s)
        except BaseException:
            _abandon(pending, storage)
            raise
        with self._lock:
            self.state, self.last_error = SaveState.WRITING, None
        self._thread = threading.Thread(target=self._commit, args=(storage, pending, record, on_commit, remember),
                                        name="zero_ray-commit", daemon=True)
        self._thread.start()
        return pending.final

    def _commit(self, storage: Storage, pending: store.PendingCheckpoint, record: RunRecord,
                on_commit: Callable[[str], None] | None, remember: bool) -> None:
        try:
            replies = self._pool.save(storage.locate(pending.tmp), record.step, phase=SavePhase.AWAIT,
                                      timeout_s=self._timeout_s)
            records = [json.loads(r.record_json) for r in replies]
            held = Position.from_data(records[0]["position"])
            if held != record.position:  # one position: the owners hold the driver's
                raise CheckpointError(f"the owners' state is at {held} but the driver's position is "
                                      f"{record.position}; not saved")
            # With shard groups only the first group writes (owner/resilience/checkpointing): G files, laid out
            # as a flat run of G owners, which is the world size a reader reshards from.
            files = [shard_file_from_data(r["file"]) for r in records if r["file"] is not None]
            if not files or record.world_size % len(files):  # one file per owner of a shard group
                raise CheckpointError(f"the owners wrote {len(files)} rank files for {record.world_size} owners, "
                                      "which is no shard group's layout; not saved")
            manifest = build_manifest(models=records, files=files,
                                      step=record.step, samples_seen=record.position.samples_seen,
                                      world_size=len(files), stage=record.stage,
                                      compute_dtype=record.training["dtype"], seed=record.training["seed"],
                                      extra=record.extra, training=record.training,
                                      config=record.config)
            path = store.commit(pending, manifest, keep=self._keep, storage=storage)
        except BaseException as err:  # the previous checkpoint stays the committed one
            log.error("checkpoint %s abandoned: %s", pending.final, err)
            _abandon(pending, storage)
            with self._lock:
                self.state, self.last_error = SaveState.FAILED, err
            return
        log.info("checkpoint committed: %s", path)
        with self._lock:
            self.state = SaveState.IDLE
            if remember:
                self.last_committed, self.last_root = path, storage.locate(pending.root)
        if on_commit is not None:
            on_commit(path)

    def join(self, *, timeout_s: float | None = None) -> BaseException | None:
        """Block until the save in flight is committed or abandoned; the error that abandoned
        the last save, as it was raised (None: committed, or none was made)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s if timeout_s is not None else 2 * self._timeout_s + 30)
            if thread.is_alive():
                raise CheckpointError(f"the checkpoint commit did not finish within {timeout_s}s")
            self._thread = None
        return self.last_error

    def wait(self, *, timeout_s: float | None = None, raise_error: bool = True) -> str | None:
        """Block until the save in flight is committed or abandoned; return the last committed
        directory, raising the failure of the last save when ``raise_error``."""
        self.join(timeout_s=timeout_s)
        if raise_error and self.last_error is not None:
            err = self.last_error
            if isinstance(err, ZeroRayError):
                raise CheckpointError(f"the last checkpoint was abandoned: {err}") from err
            raise CheckpointError(f"the last checkpoint was abandoned: {err!r}") from err
        return self.last_committed


def _abandon(pending: store.PendingCheckpoint, storage: Storage) -> None:
    """Remove a save that will not be committed; a failure to (an unreachable store) is logged,
    so that the save's own error is the one reported. What is left has no manifest: never read."""
    try:
        store.abandon(pending, storage=storage)
    except Exception as err:  # noqa: BLE001
        log.error("could not remove the abandoned checkpoint %s: %s", pending.final, err)
