"""Where checkpoints live under a root directory, and how one becomes the committed one.

::

    ROOT/
        latest                     the name of the newest committed checkpoint (atomic rewrite)
        step-00000040/             committed: complete, manifest.json present
        step-00000042/
        .step-00000044.<id>.tmp/   being written (or abandoned by a crashed writer)

A save writes every rank file into a ``.tmp`` directory, then the manifest, then renames the
directory into place and rewrites ``latest``; a crash at any point leaves the previous
checkpoint untouched and ``latest`` naming it. The last ``keep`` checkpoints are kept.

On a storage without rename (an object store: ``Storage.renames`` is False) the rank files are
written under ``step-N/`` directly: a ``step-N/`` without ``manifest.json`` is an unfinished save
that nothing reads, the manifest (written once every rank file is complete) commits it, and
``latest`` is rewritten after that. Pruning deletes a checkpoint's manifest first, so a reader
never finds a manifest whose files are being deleted.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.checkpoint.format import LATEST_NAME, MANIFEST_NAME, Manifest
from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.shardfile import ShardReader
from zero_ray.checkpoint.storage import LocalStorage, Storage
from zero_ray.core.reshard_plan import Block
from zero_ray.errors import CheckpointError

log = logging.getLogger(__name__)

_COMMITTED = re.compile(r"^step-(\d{8})(?:-(\d+))?$")
_PENDING = re.compile(r"^\.step-\d{8}(?:-\d+)?\.[0-9a-f]+\.tmp$")


@dataclass(frozen=True, kw_only=True)
class PendingCheckpoint:
    """A save in progress: rank files go into ``tmp``; ``final`` is where it will appear (the
    same place on a storage without rename)."""

    root: str
    name: str
    tmp: str
    final: str


def begin(root: str, step: int, *, storage: Storage | None = None) -> PendingCheckpoint:
    """Reserve the next checkpoint name for ``step`` under ``root`` and create its temp dir."""
    storage = storage or LocalStorage()
    storage.makedirs(root)
    taken = set(storage.listdir(root))
    name, n = f"step-{step:08d}", 0
    while name in taken:
        n += 1
        name = f"step-{step:08d}-{n}"
    final = storage.join(root, name)
    tmp = storage.join(root, f".{name}.{uuid.uuid4().hex[:12]}.tmp") if storage.renames else final
    storage.makedirs(tmp)
    return PendingCheckpoint(root=root, name=name, tmp=tmp, final=final)


def commit(pending: PendingCheckpoint, manifest: Manifest, *, keep: int, storage: Storage | None = None) -> str:
    """Write the manifest (last), publish the directory, point ``latest`` at it and drop
    checkpoints beyond the newest ``keep``. Call only once every rank file is durable."""
    storage = storage or LocalStorage()
    storage.write_atomic(storage.join(pending.tmp, MANIFEST_NAME), manifest.to_json().encode())
    if storage.renames:
        storage.publish_dir(pending.tmp, pending.final)
    storage.write_atomic(storage.join(pending.root, LATEST_NAME), pending.name.encode())
    prune(pending.root, keep=keep, storage=storage, spare=pending.name)
    return pending.final


def abandon(pending: PendingCheckpoint, *, storage: Storage | None = None) -> None:
    """Remove a save that will not be committed."""
    (storage or LocalStorage()).remove_tree(pending.tmp)


def committed(root: str, *, storage: Storage | None = None) -> list[str]:
    """Names of the committed checkpoints under ``root``, oldest first."""
    storage = storage or LocalStorage()
    if not storage.is_dir(root):
        return []
    names = []
    for name in storage.listdir(root):
        m = _COMMITTED.match(name)
        if m and storage.exists(storage.join(root, name, MANIFEST_NAME)):
            names.append((int(m.group(1)), int(m.group(2) or 0), name))
    return [n for *_, n in sorted(names)]


def prune(root: str, *, keep: int, storage: Storage | None = None, spare: str = "") -> None:
    """Drop all but the newest ``keep`` committed checkpoints. Temp dirs are left alone: one may
    belong to a save still running elsewhere (``abandon`` removes this process's failed ones)."""
    storage = storage or LocalStorage()
    names = committed(root, storage=storage)
    for name in names[:max(0, len(names) - keep)]:
        if name != spare:
            log.info("removing old checkpoint %s", storage.join(root, name))
            storage.remove(storage.join(root, name, MANIFEST_NAME))  # uncommitted first, then deleted
            storage.remove_tree(storage.join(root, name))


def resolve(path: str, *, storage: Storage | None = None) -> str:
    """The checkpoint directory ``path`` means: itself when it holds a manifest, else the one its
    ``latest`` names. Unfinished and missing checkpoints are errors that say so."""
    storage = storage or LocalStorage()
    if not storage.exists(path):
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        return path
    latest = storage.join(path, LATEST_NAME)
    if storage.exists(latest):
        name = storage.read_range(latest, 0, storage.size(latest)).decode().strip()
        target = storage.join(path, name)
        if not storage.exists(storage.join(target, MANIFEST_NAME)):
            raise CheckpointError(f"{latest} names {name!r}, which has no {MANIFEST_NAME}; the checkpoint root is "
                                  "damaged: pass one of its step-* directories explicitly")
        return target
    base = path.rstrip("/").rsplit("/", 1)[-1]
    if _PENDING.match(base) or (storage.is_dir(path) and storage.listdir(path)
                                and any(n.endswith(".safetensors") for n in storage.listdir(path))):
        raise CheckpointError(f"{path} has no {MANIFEST_NAME}: the checkpoint is still being written or its writer "
                              "died before committing it; load a committed checkpoint (its root's 'latest')")
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST_NAME}) nor a checkpoint root (no "
                          f"{LATEST_NAME}); pass the directory save_checkpoint returned or its parent")


class CheckpointReader:
    """A committed checkpoint opened for ranged reads: the manifest plus one lazily opened,
    verifying reader per rank file. ``path`` is a checkpoint or a root, on ``storage``, or else
    anything ``location.open_location`` opens (a path, a URL, a path in ``filesystem``)."""

    def __init__(self, path: str | os.PathLike[str], *, storage: Storage | None = None,
                 filesystem: Any = None) -> None:
        if storage is None:
            storage, path = open_location(path, filesystem=filesystem)
        self.storage = storage
        self.path = resolve(os.fspath(path), storage=self.storage)
        where = self.storage.join(self.path, MANIFEST_NAME)
        text = self.storage.read_range(where, 0, self.storage.size(where)).decode()
        self.manifest = Manifest.from_json(text, where=where)
        self._files: dict[int, ShardReader] = {}

    def file(self, index: int) -> ShardReader:
        if index not in self._files:
            rec = self.manifest.files[index]
            self._files[index] = ShardReader(self.storage, self.storage.join(self.path, rec.name), rec)
        return self._files[index]

    def check_files(self) -> None:
        """Every rank file is present with the recorded size (cheap: no data is read)."""
        for i in range(len(self.manifest.files)):
            self.file(i)

    def read(self, kind: str, name: str, start: int, end: int, block: Block | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of ``kind`` of parameter ``name`` (counted in ``block``, a
        TP slice; default the whole tensor), from whichever files hold them."""
        pieces = self.manifest.pieces(kind, name, start, end, block)
        if len(pieces) == 1 and pieces[0].end - pieces[0].start == end - start:
            p = pieces[0]
            return self.file(p.file).read(p.entry, p.start, p.end)
        out = torch.empty(end - start, dtype=torch.float32)
        for p in pieces:
            out[p.dest:p.dest + p.end - p.start] = self.file(p.file).read(p.entry, p.start, p.end)
        return out

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values())
