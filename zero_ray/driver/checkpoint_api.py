"""The trainer's checkpoint API: save (a snapshot on every owner, committed in the background),
load into the live owners at any stage and size, export in the Hugging Face layout, and the
root a recovery restores from. The commit thread itself is ``driver/checkpointer.py``.

Every location is a path, a URL (``s3://bucket/prefix``, ``gs://...``, ``file://...``) or a
path with a filesystem object (``checkpoint/location.py``); a filesystem object is handed to
the owners before they are asked to write or read through it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from zero_ray.checkpoint.format import Manifest
from zero_ray.checkpoint.location import open_location, shipped_filesystem
from zero_ray.checkpoint.storage import Storage
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import export_pretrained
from zero_ray.config import CheckpointConfig
from zero_ray.driver.checkpointer import Checkpointer, RunRecord
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


class CheckpointAPI:
    """Checkpoints of one run."""

    def __init__(self, pool: OwnerPool, config: CheckpointConfig) -> None:
        self._pool = pool
        self._config = config
        self.saves = Checkpointer(pool, keep=config.keep, timeout_s=config.timeout_s)

    def open(self, path: str | os.PathLike[str] | None, filesystem: Any = None, *, what: str) -> tuple[Storage, str]:
        """The storage and path of ``path`` (with ``filesystem``), else of the configured
        directory (with the configured filesystem), else a ConfigError saying how to give one.
        A filesystem object is handed to every owner first."""
        if path is None:
            if self._config.dir is None:
                raise ConfigError(f"{what} needs a path, or ZeroConfig(checkpoint=CheckpointConfig(dir=...))")
            path, filesystem = self._config.dir, self._config.filesystem
        storage, where = open_location(path, filesystem=filesystem)
        self._ship(storage)
        return storage, where

    def _ship(self, storage: Storage) -> None:
        shipped = shipped_filesystem(storage)
        if shipped is not None:
            self._pool.use_filesystem(*shipped)

    def save(self, storage: Storage, root: str, record: RunRecord, *, remember: bool = True,
             on_commit: Callable[[str], None] | None = None) -> str:
        """Snapshot every owner now, commit under ``root`` in the background; the directory.
        ``on_commit(directory)`` runs on the commit thread once the checkpoint is committed."""
        return self.saves.save(storage, root, record, remember=remember, on_commit=on_commit)

    def wait(self, timeout_s: float | None = None, *, raise_error: bool = True) -> str | None:
        return self.saves.wait(timeout_s=timeout_s, raise_error=raise_error)

    def join(self) -> BaseException | None:
        """Block until the save in flight is committed or abandoned; what abandoned it, if anything."""
        return self.saves.join()

    def recovery_root(self) -> str | None:
        """The root of the last committed save, else the configured directory (or None), as a
        string ``open_location`` opens in this process."""
        if self.saves.last_root is not None:
            return self.saves.last_root
        if self._config.dir is None:
            return None
        # Not self.open: a recovery asks this while owners may be lost, so nothing is shipped here
        # (load() ships to the rebuilt pool).
        storage, where = open_location(self._config.dir, filesystem=self._config.filesystem)
        return storage.locate(where)

    def load(self, path: str | os.PathLike[str], filesystem: Any = None, *,
             check: Callable[[Manifest, str], None] | None = None) -> Manifest:
        """Check the checkpoint at ``path`` (manifest, file sizes, and ``check(manifest,
        directory)``, which raises to refuse it), then have every owner load the ranges its own
        layout needs; returns the manifest."""
        storage, where = self.open(path, filesystem, what="load_checkpoint()")
        reader = CheckpointReader(where, storage=storage)
        m = reader.manifest
        if check is not None:
            check(m, reader.path)
        reader.check_files()
        self._pool.load(storage.locate(reader.path), timeout_s=self._config.timeout_s)
        log.info("loaded %s: step %d (saved at stage %d x %d)", reader.path, m.step, m.stage, m.world_size)
        return m

    def load_latest(self) -> Manifest:
        root = self.recovery_root()
        if root is None:
            raise CheckpointError("no checkpoint has been committed for this run")
        return self.load(root)

    def export(self, directory: str | os.PathLike[str], record: RunRecord, *, max_shard_size: str | int,
               dtype: str | None, filesystem: Any = None) -> list[str]:
        """Write the current weights into ``directory`` in the layout ``save_pretrained`` writes,
        streamed from a scratch checkpoint under it (removed afterwards; never a recovery source)."""
        storage, target = self.open(directory, filesystem, what="export_pretrained()")
        storage.makedirs(target)
        scratch = storage.join(target, f".zero_ray-export-{uuid.uuid4().hex[:12]}")
        try:
            saved = self.save(storage, scratch, record, remember=False)
            self.wait()
            return export_pretrained(saved, target, max_shard_size=max_shard_size, dtype=dtype, storage=storage)
        finally:
            storage.remove_tree(scratch)
