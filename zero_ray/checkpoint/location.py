"""Where a checkpoint lives: a path, a URL, or a filesystem object with a path, opened as a ``Storage``.

    /mnt/ckpt, ckpt, file:///mnt/ckpt   LocalStorage: fsync, then rename into place
    s3://bucket/prefix                  pyarrow's S3FileSystem; endpoint, region and credentials come
                                        from the standard environment only (AWS_ENDPOINT_URL[_S3],
                                        AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, ... or the
                                        SDK's other default sources: profile, web identity, instance role)
    gs://bucket/prefix                  pyarrow's GcsFileSystem (Application Default Credentials;
                                        STORAGE_EMULATOR_HOST for an emulator)
    other://...                         fsspec's filesystem for that protocol, where installed
    path + filesystem=fs                fs: a ``pyarrow.fs.FileSystem``, or an fsspec filesystem (wrapped
                                        with ``pyarrow.fs.FSSpecHandler``), as Ray Train's storage_filesystem

A filesystem object is registered in this process under a key, and the strings the driver
sends its owners name it by that key (``zero-ray-fs+KEY://path``); the driver ships the object
itself to every owner (through Ray) before a save or a load that uses it. Why pyarrow.fs and not
fsspec underneath: docs/checkpoints.md.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from zero_ray.checkpoint.objectstore import REGISTERED, FileSystemStorage, store_error
from zero_ray.checkpoint.storage import LocalStorage, Storage
from zero_ray.errors import CheckpointError, ConfigError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
# A URL whose "//" was collapsed (pathlib.Path("s3://b/r") is "s3:/b/r") or never written.
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(/(?!/)|(?!/))")
_STORE_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "file", "hdfs", "viewfs", "abfs", "abfss", "az", "adl", "wasb",
                  "wasbs", "oss", "http", "https", "memory", REGISTERED}


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How zero_ray's own S3 and GCS filesystems (those opened from a URL) bound each request.

    connect_timeout_s: to establish a connection. request_timeout_s: the longest a request may
    go without a byte moving. max_attempts: tries of a request that failed transiently (5xx,
    throttling, a dropped or refused connection), with exponential backoff between them. A
    store that never answers is given up on after about max_attempts x (connect + request)
    timeouts. Pass your own filesystem object for other settings.
    """

    connect_timeout_s: float = 5.0
    request_timeout_s: float = 20.0
    max_attempts: int = 4

    def __post_init__(self) -> None:
        if not (self.connect_timeout_s > 0 and self.request_timeout_s > 0):
            raise ConfigError(f"connect_timeout_s={self.connect_timeout_s!r} and request_timeout_s="
                              f"{self.request_timeout_s!r} must be > 0 seconds")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"max_attempts={self.max_attempts!r} must be an integer >= 1")


DEFAULT_OPTIONS = StoreOptions()

_lock = threading.Lock()
_FILESYSTEMS: dict[str, Any] = {}  # key -> filesystem (kept alive, so ids below stay unique)
_KEYS: dict[int, str] = {}  # id(filesystem) -> key


# -- checks (no I/O) ----------------------------------------------------------------------------------
def url_scheme(target: str) -> str | None:
    """The scheme of ``target`` if it is a URL (``s3://...`` -> ``"s3"``), else None."""
    m = _URL.match(target)
    return m.group(1).lower() if m else None


def check_location(target: object, filesystem: object = None) -> str:
    """``target`` as a string, after the checks that need no I/O: a path, a URL, or (with
    ``filesystem``) a path inside that filesystem. A path that looks like a mangled URL
    (``s3:/bucket``, as ``pathlib.Path`` makes of ``s3://bucket``) is refused rather than written
    as a local directory of that name."""
    if not isinstance(target, (str, os.PathLike)):
        raise ConfigError(f"checkpoint location {target!r} must be a path, a URL (s3://bucket/prefix) or a path "
                          "with filesystem=")
    text = os.fspath(target)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"checkpoint location {target!r} must be a non-empty string path or URL")
    scheme = url_scheme(text)
    if filesystem is not None:
        _check_filesystem(filesystem)
        if scheme is not None:
            raise ConfigError(f"with filesystem= the location is a path inside that filesystem, not the URL {text!r}: "
                              f"pass {_URL.match(text).group(2)!r}")  # type: ignore[union-attr]
        return text
    mangled = _MANGLED.match(text)
    if scheme is None and mangled and (mangled.group(2) == "/" or mangled.group(1).lower() in _STORE_SCHEMES):
        raise ConfigError(f"checkpoint location {text!r} looks like a URL that lost its '//' (pathlib.Path collapses "
                          f"'s3://' to 's3:/'); pass the URL as a string, e.g. '{mangled.group(1)}://"
                          f"{text[len(mangled.group(0)):].lstrip('/')}'. A local directory of that name is refused "
                          "so that a checkpoint never silently lands on a pod's own disk")
    if scheme in ("s3", "gs", "gcs") and not _URL.match(text).group(2).split("/", 1)[0]:  # type: ignore[union-attr]
        raise ConfigError(f"checkpoint location {text!r} names no bucket; write {scheme}://BUCKET/PREFIX")
    if scheme is not None and scheme not in ("s3", "gs", "gcs", "file") and not scheme.startswith(REGISTERED + "+") \
            and scheme not in _fsspec_protocols():
        raise ConfigError(f"checkpoint location {text!r}: no filesystem is known for {scheme}://; use s3://, gs://, "
                          "file://, a local path, an fsspec protocol, or a path with filesystem=")
    return text


def _fsspec_protocols() -> set[str]:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return set()
    return set(known_implementations) | set(registry)


def _check_filesystem(fs: object) -> None:
    if _is_arrow(fs) or _is_fsspec(fs):
        return
    raise ConfigError(f"filesystem={fs!r} must be a pyarrow.fs.FileSystem (e.g. pyarrow.fs.S3FileSystem(...)) or an "
                      "fsspec filesystem")


def _is_arrow(fs: object) -> bool:
    try:
        import pyarrow.fs as pafs
    except ImportError:
        return False
    return isinstance(fs, pafs.FileSystem)


def _is_fsspec(fs: object) -> bool:
    try:
        from fsspec import AbstractFileSystem
    except ImportError:
        return False
    return isinstance(fs, AbstractFileSystem)


# -- registered filesystem objects ------------------------------------------------------------------
def register_filesystem(fs: Any, key: str | None = None) -> str:
    """Keep ``fs`` in this process under ``key`` (default: a new key, or the one ``fs`` already
    has) and return the key."""
    with _lock:
        if key is None:
            key = _KEYS.get(id(fs)) or uuid.uuid4().hex[:16]
        _FILESYSTEMS[key] = fs
        _KEYS[id(fs)] = key
    return key


def shipped_filesystem(storage: Storage) -> tuple[str, Any] | None:
    """(key, filesystem) when ``storage`` is on a registered filesystem object: what the driver
    hands every owner before it asks them to save or load there."""
    key = getattr(storage, "key", None)
    return (key, _FILESYSTEMS[key]) if key is not None else None


# -- opening -----------------------------------------------------------------------------------------
def open_location(target: str | os.PathLike[str], *, filesystem: Any = None,
                  options: StoreOptions | None = None) -> tuple[Storage, str]:
    """The storage ``target`` is on and the path to use with it (see the module docstring).
    Opening does no I/O except, for ``s3://`` without an endpoint or a region in the
    environment, asking S3 for the bucket's region."""
    text = check_location(target, filesystem)
    options = options or DEFAULT_OPTIONS
    if filesystem is not None:
        return _wrapped(filesystem), text
    scheme = url_scheme(text)
    if scheme is None:
        return LocalStorage(), text
    rest = _URL.match(text).group(2)  # type: ignore[union-attr]
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest.startswith("/"):
            raise ConfigError(f"{text!r}: a file:// URL needs an absolute path (file:///mnt/ckpt)")
        return LocalStorage(), rest
    if scheme.startswith(REGISTERED + "+"):
        key = scheme.split("+", 1)[1]
        with _lock:
            fs = _FILESYSTEMS.get(key)
        if fs is None:
            raise CheckpointError(f"{text}: no filesystem object is registered in this process as {key!r} (the "
                                  "driver ships it to every owner before a save or load that uses it)")
        return _wrapped(fs, key=key), rest
    if scheme == "s3":
        return _s3(rest.split("/", 1)[0], options), f"s3://{rest}"
    if scheme in ("gs", "gcs"):
        return _gcs(options, scheme), f"{scheme}://{rest}"
    return _fsspec(text, scheme), text


def _wrapped(fs: Any, key: str | None = None) -> FileSystemStorage:
    """A storage on the user's filesystem object, registered so owners can be given it."""
    key = register_filesystem(fs, key)
    arrow = fs
    if not _is_arrow(fs):
        import pyarrow.fs as pafs

        arrow = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    return FileSystemStorage(arrow, key=key, where=f"{type(fs).__name__} passed as filesystem=")


def _s3(bucket: str, options: StoreOptions) -> FileSystemStorage:
    import pyarrow.fs as pafs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    if region is None and endpoint is None:
        try:
            region = pafs.resolve_s3_region(bucket)
        except OSError as err:
            raise store_error(err, op="finding the bucket's region", path=f"s3://{bucket}",
                              where="AWS S3; set AWS_REGION to skip this lookup") from err
    fs = pafs.S3FileSystem(
        region=region or "us-east-1", endpoint_override=endpoint, connect_timeout=options.connect_timeout_s,
        request_timeout=options.request_timeout_s,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=options.max_attempts),
        # Small objects (manifest, latest) go up in one PUT instead of a three-request multipart upload.
        allow_delayed_open=True)
    where = f"endpoint {endpoint}" if endpoint else f"AWS S3 in {region}"
    return FileSystemStorage(fs, prefix="s3://", where=where)


def _gcs(options: StoreOptions, scheme: str) -> FileSystemStorage:
    import pyarrow.fs as pafs

    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    limit = timedelta(seconds=options.max_attempts * (options.connect_timeout_s + options.request_timeout_s))
    if emulator:
        host = emulator.split("://", 1)[-1]
        scheme_of = emulator.split("://", 1)[0] if "://" in emulator else "http"
        fs = pafs.GcsFileSystem(anonymous=True, endpoint_override=host, scheme=scheme_of, retry_time_limit=limit)
    else:
        fs = pafs.GcsFileSystem(retry_time_limit=limit)
    return FileSystemStorage(fs, prefix=f"{scheme}://", where=f"GCS endpoint {emulator}" if emulator else "GCS")


def _fsspec(url: str, scheme: str) -> FileSystemStorage:
    try:
        import fsspec
        import pyarrow.fs as pafs

        fs = fsspec.filesystem(scheme)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"{url}: no filesystem for {scheme}:// ({err}); use s3://, gs://, file:// or a local path, "
                          "install the fsspec package for that protocol, or pass filesystem=") from err
    # fsspec's methods take the URL itself and strip the protocol, so paths stay URLs.
    return FileSystemStorage(pafs.PyFileSystem(pafs.FSSpecHandler(fs)), where=f"fsspec {type(fs).__name__}")
