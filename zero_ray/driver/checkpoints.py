"""The trainer's checkpoint API: save (a snapshot on every owner, committed in the background),
load into the live owners at any stage and size, export in the Hugging Face layout, and the
root a recovery restores from. The commit thread itself is ``driver/checkpointer.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from zero_ray.checkpoint.format import Manifest
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import export_pretrained
from zero_ray.config import CheckpointConfig
from zero_ray.driver.checkpointer import Checkpointer, RunPosition
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


class CheckpointAPI:
    """Checkpoints of one run."""

    def __init__(self, pool: OwnerPool, config: CheckpointConfig) -> None:
        self._pool = pool
        self._config = config
        self.saves = Checkpointer(pool, keep=config.keep, timeout_s=config.timeout_s)

    def root_for(self, path: str | os.PathLike[str] | None, *, what: str) -> str:
        """``path``, else the configured directory, else a ConfigError saying how to give one."""
        root = path if path is not None else self._config.dir
        if root is None:
            raise ConfigError(f"{what} needs a path, or ZeroConfig(checkpoint=CheckpointConfig(dir=...))")
        return os.fspath(root)

    def save(self, root: str, position: RunPosition, *, remember: bool = True) -> str:
        """Snapshot every owner now, commit under ``root`` in the background; the directory."""
        return self.saves.save(root, position, remember=remember)

    def wait(self, timeout_s: float | None = None, *, raise_error: bool = True) -> str | None:
        return self.saves.wait(timeout_s=timeout_s, raise_error=raise_error)

    def recovery_root(self) -> str | None:
        """The root of the last committed save, else the configured directory (or None)."""
        last = self.saves.last_committed
        if last is not None:
            return os.path.dirname(last)
        return os.fspath(self._config.dir) if self._config.dir else None

    def load(self, path: str) -> Manifest:
        """Check the checkpoint at ``path`` (manifest, file sizes), then have every owner load
        the ranges its own layout needs; returns the manifest."""
        reader = CheckpointReader(path)
        m = reader.manifest
        reader.check_files()
        self._pool.load(reader.path, timeout_s=self._config.timeout_s)
        log.info("loaded %s: step %d (saved at stage %d x %d)", reader.path, m.step, m.stage, m.world_size)
        return m

    def load_latest(self) -> Manifest:
        root = self.recovery_root()
        if root is None:
            raise CheckpointError("no checkpoint has been committed for this run")
        return self.load(root)

    def export(self, directory: str | os.PathLike[str], position: RunPosition, *, max_shard_size: str | int,
               dtype: str | None) -> list[str]:
        """Write the current weights into ``directory`` in the layout ``save_pretrained`` writes,
        streamed from a scratch checkpoint under it (removed afterwards; never a recovery source)."""
        target = os.fspath(directory)
        os.makedirs(target, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".zero_ray-export-", dir=target)
        try:
            saved = self.save(scratch, position, remember=False)
            self.wait()
            return export_pretrained(saved, target, max_shard_size=max_shard_size, dtype=dtype)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
