"""An abortable rendezvous for torch.distributed: a ``Store`` kept in Ray's internal key-value
store (the GCS every node reaches), whose blocking calls give up the moment the run aborts.

Forming a gloo group blocks every rank until all have arrived: ``ray.util.collective``'s own
rendezvous waits on Ray's key-value store and then on a TCP store hosted by rank 0, neither of
which another thread can interrupt. A rank lost before it arrives left the others stuck for
the whole timeout, and the driver had to treat them as lost too (their memory, and the peer
copies in it, with them). Here the default process group is formed over ``KVStore``, whose
``get`` and ``wait`` poll with a short, growing interval and raise ``RendezvousAborted`` once
``abort`` is set (or the deadline passes); ``ray.util.collective`` then makes its named group
over that default group (a ``new_group``, whose barrier uses the same store), so the whole
formation can be aborted at any point and leaves the process free to form the next one.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Sequence

import torch.distributed as dist

from zero_ray.errors import CollectiveError, CollectiveTimeout

NAMESPACE = "zero_ray_rdzv"
_LIVE: list[KVStore | None] = [None]  # the store the process's default group was formed over
_POLL_MIN_S, _POLL_MAX_S = 0.002, 0.05


class RendezvousAborted(CollectiveError):
    """The group's formation was aborted (a member was lost, or the run is being torn down)."""


def _kv():  # type: ignore[no-untyped-def]
    # imported on first use, as Ray was before: only a process forming a group needs it
    from zero_ray.compat import ray_private

    return ray_private


class KVStore(dist.Store):
    """``torch.distributed.Store`` over Ray's internal key-value store, under ``prefix``."""

    def __init__(self, prefix: str, *, abort: threading.Event, timeout_s: float) -> None:
        super().__init__()
        self._prefix = prefix.rstrip("/") + "/"
        self._abort = abort
        self._timeout_s = timeout_s

    def _key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def _poll(self, ready, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + self._timeout_s
        delay = _POLL_MIN_S
        while not ready():
            if self._abort.is_set():
                raise RendezvousAborted(f"forming {self._prefix.rstrip('/')} was aborted while waiting for {what}")
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"forming {self._prefix.rstrip('/')} timed out after {self._timeout_s:g}s "
                                        f"waiting for {what}")
            self._abort.wait(delay)  # an abort ends the wait at once
            delay = min(_POLL_MAX_S, delay * 2)

    # -- the Store interface torch.distributed uses --------------------------------------------
    def clone(self) -> KVStore:
        # gloo takes a copy of the store per connection it sets up; ours is stateless
        return KVStore(self._prefix, abort=self._abort, timeout_s=self._timeout_s)

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        _kv().kv_put(self._key(key), data, overwrite=True, namespace=NAMESPACE)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = _kv().kv_get(self._key(key), namespace=NAMESPACE)
        if value is None:
            raise CollectiveError(f"rendezvous key {key!r} of {self._prefix} vanished")
        return value

    def add(self, key: str, amount: int) -> int:
        # No atomic counter in the key-value store: each add is a key of its own under the
        # counter's prefix, and the value is their sum (what an atomic add would return, up to
        # adds racing with this one, which a counter cannot order either).
        kv = _kv()
        if amount:
            kv.kv_put(self._key(f"{key}/+{uuid.uuid4().hex}"), str(amount).encode(), overwrite=False,
                      namespace=NAMESPACE)
        names = kv.kv_list(self._key(f"{key}/+"), namespace=NAMESPACE)
        return sum(int(kv.kv_get(n, namespace=NAMESPACE) or b"0") for n in names)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        kv = _kv()
        if not want:  # set if absent: atomic in the key-value store
            kv.kv_put(self._key(key), new, overwrite=False, namespace=NAMESPACE)
            return kv.kv_get(self._key(key), namespace=NAMESPACE) or new
        current = kv.kv_get(self._key(key), namespace=NAMESPACE)
        if current == want:  # only the rendezvous's own bookkeeping swaps values: no race to lose
            kv.kv_put(self._key(key), new, overwrite=True, namespace=NAMESPACE)
            return new
        return current if current is not None else want

    def check(self, keys: Sequence[str]) -> bool:
        kv = _kv()
        return all(kv.kv_exists(self._key(k), namespace=NAMESPACE) for k in keys)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._poll(lambda: self.check(keys), f"keys {list(keys)}")

    def delete_key(self, key: str) -> bool:
        return bool(_kv().kv_delete(self._key(key), namespace=NAMESPACE))

    def num_keys(self) -> int:
        return len(_kv().kv_list(self._prefix.encode(), namespace=NAMESPACE))


def form_default_group(name: str, *, rank: int, world_size: int, timeout_s: float,
                       abort: threading.Event) -> None:
    """Form torch.distributed's default (gloo) group over a ``KVStore`` under ``name``."""
    if dist.is_initialized():
        raise CollectiveError(f"rank {rank}: a process group is still formed; destroy it before forming {name!r}")
    store = KVStore(name, abort=abort, timeout_s=timeout_s)
    # torch keeps only the C++ half of a Python store: the Python object must outlive the group
    # (groups made later over it, a new_group, call back into it), so it is held here until the
    # next formation replaces it.
    _LIVE[0] = store
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def clear(prefix: str) -> None:
    """Remove every rendezvous key whose group name starts with ``prefix`` (the driver, at
    shutdown: a run's groups are all named after it)."""
    _kv().kv_delete(prefix.encode(), by_prefix=True, namespace=NAMESPACE)
