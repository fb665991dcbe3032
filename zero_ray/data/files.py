"""The files a data source names: resolved (globs expanded, sizes read) and read by ranges.

Locations open as checkpoints do (``checkpoint/location.open_location``): a local path, a URL
(``s3://``, ``gs://``, ``file://``, an fsspec protocol) or a path inside a filesystem object
(``pyarrow.fs`` or fsspec), whose credentials and endpoint come from the standard environment
(``AWS_*``) of the driver and of every owner. A glob may stand in the last path component
(``s3://bucket/corpus/train_*.bin``); its matches are read in sorted order.

Errors name the file. A read that fails for a reason that can pass (the store unreachable or
erring, a dropped connection) is tried again with backoff (``READ_ATTEMPTS``; the object-store
clients retry each request underneath as well); a read that still fails, or one that cannot pass
(no such file, credentials refused, a file shorter than listed), is a ``DataError``.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.objectstore import classify
from zero_ray.checkpoint.storage import RangedFile, Storage
from zero_ray.errors import CheckpointError, ConfigError, DataError

log = logging.getLogger(__name__)

T = TypeVar("T")

READ_ATTEMPTS = 4  # tries of one read; backoff BACKOFF_S * 4**attempt between them
BACKOFF_S = 0.1
_GLOB = set("*?[")


@dataclass(frozen=True)
class DataFile:
    """One file of a source: its location (a path, a URL, or a path in the source's filesystem
    object; a glob's match as its storage names it: ``s3://`` stays a URL) and its size."""

    url: str
    size: int


def _locations(urls: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(urls, str):
        return (urls,)
    if not isinstance(urls, Sequence) or not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"urls={urls!r} must be a path, URL or glob, or a non-empty list of them")
    return tuple(urls)


def resolve(urls: str | Sequence[str], *, filesystem: Any = None, what: str) -> tuple[DataFile, ...]:
    """The files ``urls`` name, in order (each glob's matches sorted), with their sizes. Reads
    metadata only. ``what`` names the source in errors."""
    out: list[DataFile] = []
    for url in _locations(urls):
        storage, path = _open(url, filesystem, what)
        head, tail = posixpath.split(path)
        if _GLOB & set(tail):
            if _GLOB & set(head):
                raise ConfigError(f"{what}: {url!r} has a glob outside its last path component; only the file name "
                                  "may hold * ? [")
            names = [n for n in _guard(lambda: storage.listdir(head), url, "listing its directory")
                     if fnmatch.fnmatchcase(n, tail)]
            if not names:
                raise DataError(f"{what}: {url!r} matches no file (in {head!r})")
            paths = [storage.join(head, n) for n in names]
        else:
            paths = [path]
        for p in paths:
            try:
                size = _guard(lambda: storage.size(p), p, "reading its size")
            except FileNotFoundError as err:
                raise DataError(f"{what}: {p} does not exist") from err
            out.append(DataFile(url=p, size=size))
    return tuple(out)


def _open(url: str, filesystem: Any, what: str) -> tuple[Storage, str]:
    try:
        return open_location(url, filesystem=filesystem)
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}".replace("checkpoint location", "data location")) from err
    except CheckpointError as err:
        raise DataError(f"{what}: {err}") from err


def _guard(fn: Callable[[], T], path: str, op: str) -> T:
    """``fn()``; a store failure becomes a DataError naming ``path``."""
    try:
        return fn()
    except FileNotFoundError:
        raise
    except (CheckpointError, OSError) as err:
        raise DataError(f"{path}: {op} failed: {err}") from err


def _transient(err: BaseException) -> bool:
    """Whether a read error may pass: not a missing file, refused credentials or access, or a
    file shorter than it was listed (what a retry cannot change)."""
    if isinstance(err, FileNotFoundError):
        return False
    cause = err.__cause__ if isinstance(err, CheckpointError) and err.__cause__ is not None else err
    if isinstance(err, CheckpointError) and cause is err:  # ours: a short read (truncated file)
        return False
    return classify(cause) in ("unreachable", "other")


class FileReader:
    """Reads byte ranges of a source's files on an owner (each file opened once, lazily)."""

    def __init__(self, files: Sequence[DataFile], *, filesystem: Any = None, what: str) -> None:
        self._files = tuple(files)
        self._filesystem = filesystem
        self._what = what
        self._storages: dict[str, tuple[Storage, str]] = {}
        self._handles: dict[str, RangedFile] = {}  # ranged reads are safe from several threads at once

    def _location(self, url: str) -> tuple[Storage, str]:
        if url not in self._storages:  # a race opens twice, harmlessly
            self._storages[url] = _open(url, self._filesystem, self._what)
        return self._storages[url]

    def read(self, index: int, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)`` of file ``index``, retried with backoff (the file
        is opened once, for every read: an object store's open asks for its size)."""
        f = self._files[index]

        def attempt() -> bytes:
            handle = self._handles.get(f.url)
            if handle is None:
                storage, path = self._location(f.url)
                handle = self._handles[f.url] = storage.open_ranged(path)
            try:
                return handle.read(offset, size)
            except BaseException:
                self._handles.pop(f.url, None)  # opened again on the next try
                raise

        return self.retrying(attempt, f.url, f"reading bytes [{offset}, {offset + size})")

    def open_input(self, index: int) -> Any:
        """File ``index`` opened as a random-access file object (the caller closes it)."""
        f = self._files[index]
        storage, path = self._location(f.url)
        return self.retrying(lambda: storage.open_input(path), f.url, "opening it")

    @staticmethod
    def retrying(fn: Callable[[], T], url: str, op: str) -> T:
        """``fn()``, tried ``READ_ATTEMPTS`` times while its error may pass; then a DataError."""
        for attempt in range(READ_ATTEMPTS):
            try:
                return fn()
            except (OSError, CheckpointError) as err:
                if not _transient(err):
                    raise DataError(f"{url}: {op} failed: {err}") from err
                if attempt == READ_ATTEMPTS - 1:
                    raise DataError(f"{url}: {op} failed {READ_ATTEMPTS} times (retried with backoff): {err}") from err
                log.warning("%s: %s failed (%s); retrying", url, op, err)
                time.sleep(BACKOFF_S * 4**attempt)  # backoff before the next try, not synchronisation
        raise AssertionError("unreachable")
