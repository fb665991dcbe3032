"""Storage: the few file operations a checkpoint needs, behind a small interface.

``LocalStorage`` is a local or shared POSIX filesystem: a save writes into a temp directory
and publishes it with one rename. ``objectstore.FileSystemStorage`` is any pyarrow filesystem
(S3, GCS, or an fsspec one wrapped), where there is no rename: each object appears whole when
its upload completes, and a checkpoint counts only once its manifest, written last, exists.
``location.open_location`` turns a path, a URL or a filesystem object into one of these.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO, Protocol

from zero_ray.errors import CheckpointError


class RangedFile(Protocol):
    """An open file or object for reads by byte range."""

    size: int

    def read(self, offset: int, size: int) -> bytes: ...


class Storage(Protocol):
    """Paths are ``/``-separated strings; every write is durable when its call returns. A missing
    path raises ``FileNotFoundError``; any other failure of the store a ``CheckpointError``."""

    # True: a save is written under a temp name and renamed into place (``publish_dir``).
    # False: it is written where it will stay, and only its manifest (written last) commits it.
    renames: bool

    def join(self, *parts: str) -> str: ...

    def locate(self, path: str) -> str:
        """``path`` as a string any process can open with ``location.open_location`` (an owner's
        Save and Load get these)."""
        ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def listdir(self, path: str) -> list[str]: ...

    def makedirs(self, path: str) -> None: ...

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A new file, durable once the block exits without an error."""
        ...

    def open_replace(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A file that replaces ``path`` whole when the block exits without an error, and is not
        left behind when it raises."""
        ...

    def open_ranged(self, path: str) -> RangedFile: ...

    def open_input(self, path: str) -> BinaryIO:
        """``path`` opened for random-access reads as a file object (what ``pyarrow.parquet``
        reads footers and row groups from); the caller closes it."""

    def read_range(self, path: str, offset: int, size: int) -> bytes: ...

    def write_atomic(self, path: str, data: bytes) -> None: ...

    def publish_dir(self, tmp: str, final: str) -> None: ...

    def remove(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a rename counts only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def short_read(path: str, offset: int, size: int, got: int) -> CheckpointError:
    return CheckpointError(f"{path}: wanted {size} bytes at offset {offset}, the file has only {got} there "
                           "(truncated?)")


class _LocalRanged:
    """A local file read by ranges; opened per read so that no descriptor outlives a read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.stat(path).st_size

    def read(self, offset: int, size: int) -> bytes:
        with open(self.path, "rb") as fh:
            data = os.pread(fh.fileno(), size, offset)
        if len(data) != size:
            raise short_read(self.path, offset, size, len(data))
        return data


class LocalStorage:
    """A POSIX filesystem: fsync before a file counts, rename to publish."""

    renames = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def locate(self, path: str) -> str:
        return path

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

    @contextmanager
    def open_replace(self, path: str) -> Iterator[BinaryIO]:
        """Written to a temp file beside ``path``, fsynced and renamed over it (removed on error)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        fsync_dir(os.path.dirname(os.path.abspath(path)))

    def open_ranged(self, path: str) -> RangedFile:
        return _LocalRanged(path)

    def open_input(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return _LocalRanged(path).read(offset, size)

    def write_atomic(self, path: str, data: bytes) -> None:
        """``path`` holds either its old content or ``data``, never a mix (temp file + rename)."""
        with self.open_replace(path) as fh:
            fh.write(data)

    def publish_dir(self, tmp: str, final: str) -> None:
        """Make the finished directory ``tmp`` visible as ``final`` in one step."""
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
