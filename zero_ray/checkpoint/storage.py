"""Storage: the few file operations a checkpoint needs, behind a small interface.

``LocalStorage`` is a local or shared filesystem (what a KubeRay job mounts as a volume). An
object store fits the same interface later: whole-object writes, ranged reads, a listing, and
an atomic "publish" (rename here, a final manifest object there).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO, Protocol

from zero_ray.errors import CheckpointError


class Storage(Protocol):
    """Paths are ``/``-separated strings; every write is durable when its call returns."""

    def join(self, *parts: str) -> str: ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def listdir(self, path: str) -> list[str]: ...

    def makedirs(self, path: str) -> None: ...

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]: ...

    def read_range(self, path: str, offset: int, size: int) -> bytes: ...

    def write_atomic(self, path: str, data: bytes) -> None: ...

    def publish_dir(self, tmp: str, final: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a rename counts only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A POSIX filesystem: fsync before a file counts, rename to publish."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """A new file, flushed and fsynced when the block exits without an error."""
        with open(path, "xb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), size, offset)
        if len(data) != size:
            raise CheckpointError(f"{path}: wanted {size} bytes at offset {offset}, the file has only "
                                  f"{len(data)} there (truncated?)")
        return data

    def write_atomic(self, path: str, data: bytes) -> None:
        """``path`` holds either its old content or ``data``, never a mix (temp file + rename)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))

    def publish_dir(self, tmp: str, final: str) -> None:
        """Make the finished directory ``tmp`` visible as ``final`` in one step."""
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
