"""Checkpoints on any pyarrow filesystem: S3 and GCS natively, anything fsspec offers wrapped.

An object store has no rename, so nothing is published by moving it. Each rank's file is one
object, uploaded in parts (several in flight at once, by pyarrow's IO threads) straight from
its owner; an object becomes visible only when its upload completes, so a writer killed
midway leaves no object at all. A checkpoint counts only once its manifest exists, and the
manifest is written after every rank's object is complete (``store.commit``).

Every failure of the store becomes a ``CheckpointError`` naming the path (a URL where the
checkpoint was given as one), what was being done and what to check: the credentials, the
endpoint, the bucket. Retries with backoff of transient errors are the filesystem's own
(``location.StoreOptions`` for URLs); nothing here retries on top of them.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, TypeVar

from zero_ray.checkpoint.storage import RangedFile, short_read
from zero_ray.errors import CheckpointError

T = TypeVar("T")

REGISTERED = "zero-ray-fs"  # scheme prefix of paths on a filesystem object registered by key

# Substrings of the messages pyarrow (AWS SDK, google-cloud-cpp) and common fsspec backends give.
_CREDENTIALS = ("INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                "EXPIRED_TOKEN", "ExpiredToken", "InvalidToken", "INVALID_CLIENT_TOKEN_ID", "UNAUTHENTICATED",
                "UNRECOGNIZED_CLIENT", "MISSING_AUTHENTICATION_TOKEN", "No credentials", "Unable to locate credentials")
_DENIED = ("ACCESS_DENIED", "AccessDenied", "PERMISSION_DENIED", "Forbidden")
_UNREACHABLE = ("NETWORK_CONNECTION", "curlCode", "Could not connect", "Connection refused", "Timeout was reached",
                "timed out", "UNAVAILABLE", "Could not resolve", "REQUEST_TIMEOUT")
_NO_BUCKET = ("NO_SUCH_BUCKET", "NoSuchBucket", "The specified bucket does not exist")


def _text(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def classify(err: BaseException) -> str:
    """``credentials``, ``denied``, ``unreachable``, ``no_bucket`` or ``other``."""
    text = _text(err)
    if any(s in text for s in _CREDENTIALS):
        return "credentials"
    if isinstance(err, PermissionError) or any(s in text for s in _DENIED):
        return "denied"
    if isinstance(err, (ConnectionError, TimeoutError)) or any(s in text for s in _UNREACHABLE):
        return "unreachable"
    return "no_bucket" if any(s in text for s in _NO_BUCKET) else "other"


def store_error(err: BaseException, *, op: str, path: str, where: str) -> CheckpointError:
    """A ``CheckpointError`` for ``err`` raised while ``op`` on ``path`` (of the store ``where``
    describes), saying what kind of failure it is and what to check. Never holds a secret: the
    message is the path, the endpoint and the store's own error text."""
    text, kind = _text(err), classify(err)
    if kind == "credentials":
        return CheckpointError(
            f"{path}: the object store ({where}) refused the credentials while {op} ({text}). The credentials are "
            "wrong, expired or unknown to this store: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
            "AWS_SESSION_TOKEN (or GOOGLE_APPLICATION_CREDENTIALS) in the environment of the driver and of every "
            "owner's node, or the credentials of the filesystem object passed in")
    if kind == "denied":
        return CheckpointError(
            f"{path}: access denied by the object store ({where}) while {op} ({text}). The credentials are wrong, "
            "or they lack permission on this bucket and prefix (a checkpoint needs list, get, put and delete)")
    if kind == "unreachable":
        return CheckpointError(
            f"{path}: cannot reach the object store ({where}) while {op}, after retrying with backoff ({text}). "
            "Check AWS_ENDPOINT_URL (or the filesystem's endpoint), the network, and that the store is up")
    if kind == "no_bucket":
        return CheckpointError(f"{path}: the bucket does not exist ({where}) ({text}); create it first (zero_ray "
                               "never creates buckets)")
    return CheckpointError(f"{path}: the object store ({where}) failed while {op}, after retrying transient errors "
                           f"with backoff: {text}")


def registered_url(key: str, path: str) -> str:
    """The string naming ``path`` inside the filesystem object registered as ``key`` (see
    ``location.register_filesystem``)."""
    return f"{REGISTERED}+{key}://{path}"


class _ObjectRanged:
    """One object opened for ranged GETs; its size is known from opening it."""

    def __init__(self, storage: FileSystemStorage, path: str, handle: Any) -> None:
        self._storage, self._path, self._handle = storage, path, handle
        self.size = storage.call(f"reading the size of {path}", path, handle.size)

    def read(self, offset: int, size: int) -> bytes:
        data = self._storage.call(f"reading bytes [{offset}, {offset + size})", self._path,
                                  lambda: self._handle.read_at(size, offset))
        if len(data) != size:
            raise short_read(self._path, offset, size, len(data))
        return data


class FileSystemStorage:
    """A ``Storage`` on a ``pyarrow.fs.FileSystem``.

    ``prefix``: what the paths of this storage start with and the filesystem's own paths lack
    (``"s3://"`` for one opened from a URL, so that every path and every message is a URL).
    ``key``: set for a filesystem object the user passed in; ``locate`` then names it by that
    key, under which it is registered in this process and shipped to the owners.
    ``where``: the store in words, for messages (an endpoint, a region, a class name).
    """

    renames = False

    def __init__(self, fs: Any, *, prefix: str = "", key: str | None = None, where: str = "") -> None:
        self.fs = fs
        self.prefix = prefix
        self.key = key
        self.where = where or type(fs).__name__
        # Object stores have no directories, only key prefixes: create_dir would write marker
        # objects, and a single upload is already atomic.
        self.object_store = fs.type_name in ("s3", "gcs", "abfs") or any(
            p in fs.type_name for p in ("'s3'", "'gs'", "'gcs'", "'abfs'", "'az'"))

    # -- paths ----------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def locate(self, path: str) -> str:
        return registered_url(self.key, path) if self.key is not None else path

    def _fs(self, path: str) -> str:
        if self.prefix and not path.startswith(self.prefix):
            raise CheckpointError(f"{path} is not under {self.prefix} (mixed up locations)")
        return path[len(self.prefix):].rstrip("/")

    def call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``, with a failure of the store (not a missing path) as a ``CheckpointError``."""
        try:
            return fn()
        except (FileNotFoundError, CheckpointError):
            raise
        except OSError as err:
            raise self._error(err, op, path) from err

    def _error(self, err: OSError, op: str, path: str) -> CheckpointError:
        if classify(err) == "denied":
            # S3 answers a HEAD with a bare 403: no body to say whether the credentials are wrong
            # or only lack permission. A listing's error says which.
            import pyarrow.fs as pafs

            parent = posixpath.dirname(self._fs(path)) or self._fs(path)
            try:
                self.fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
            except OSError as probe:
                if classify(probe) == "credentials":
                    return store_error(probe, op=op, path=path, where=self.where)
        return store_error(err, op=op, path=path, where=self.where)

    def _info(self, path: str) -> Any:
        return self.call("looking it up", path, lambda: self.fs.get_file_info(self._fs(path)))

    # -- queries --------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        import pyarrow.fs as pafs

        return self._info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        import pyarrow.fs as pafs

        return self._info(path).type == pafs.FileType.Directory

    def size(self, path: str) -> int:
        import pyarrow.fs as pafs

        info = self._info(path)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{path} does not exist")
        return int(info.size)

    def listdir(self, path: str) -> list[str]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self._fs(path), allow_not_found=True)
        infos = self.call("listing it", path, lambda: self.fs.get_file_info(selector))
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if not self.object_store:
            self.call("creating it", path, lambda: self.fs.create_dir(self._fs(path), recursive=True))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """One upload (multipart, parts sent in the background) that completes when the block
        exits. pyarrow cannot abort an upload, so on an error the object is closed and deleted."""
        stream = self.call("starting an upload", path, lambda: self.fs.open_output_stream(self._fs(path)))
        try:
            yield _Guarded(self, path, stream)
        except BaseException:
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            self.remove(path)
            raise
        self.call("completing the upload", path, stream.close)

    @contextmanager
    def open_replace(self, path: str) -> Iterator[BinaryIO]:
        if self.object_store:  # an object is replaced whole when its upload completes
            with self.open_write(path) as fh:
                yield fh
            return
        tmp = f"{path}.tmp-upload"
        with self.open_write(tmp) as fh:
            yield fh
        self.call("moving it into place", path, lambda: self.fs.move(self._fs(tmp), self._fs(path)))

    def write_atomic(self, path: str, data: bytes) -> None:
        with self.open_replace(path) as fh:
            fh.write(data)

    def publish_dir(self, tmp: str, final: str) -> None:
        if tmp != final:  # store.begin writes in place when renames is False
            raise CheckpointError(f"cannot publish {tmp} as {final}: {self.where} has no rename")

    def remove(self, path: str) -> None:
        try:
            self.call("deleting it", path, lambda: self.fs.delete_file(self._fs(path)))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        try:
            self.call("deleting it", path, lambda: self.fs.delete_dir(self._fs(path)))
        except FileNotFoundError:
            pass

    # -- reads ----------------------------------------------------------------------------------
    def open_ranged(self, path: str) -> RangedFile:
        handle = self.call("opening it", path, lambda: self.fs.open_input_file(self._fs(path)))
        return _ObjectRanged(self, path, handle)

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return self.open_ranged(path).read(offset, size)

    def open_input(self, path: str) -> Any:
        return self.call("opening it", path, lambda: self.fs.open_input_file(self._fs(path)))


class _Guarded:
    """An output stream whose failures (a part upload that exhausted its retries) are
    ``CheckpointError``s naming the object."""

    def __init__(self, storage: FileSystemStorage, path: str, stream: Any) -> None:
        self._storage, self._path, self._stream = storage, path, stream

    def write(self, data: Any) -> int:
        return self._storage.call("uploading", self._path, lambda: self._stream.write(data))

    def flush(self) -> None:
        self._storage.call("uploading", self._path, self._stream.flush)
