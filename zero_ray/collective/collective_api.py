"""The collectives ZeRO needs, as a protocol, with counters of the bytes each rank sends.

Every operation works in place on a flat buffer whose length is a multiple of the world size,
split into ``world_size`` equal chunks; chunk ``r`` belongs to rank ``r``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class ByteCounters:
    """Bytes this rank has sent, by collective, since the last ``reset()``; and by the world rank
    they went to, where the sender says (``by_peer``: what splits them into inside-node and
    cross-node bytes). Locked: with tensor parallelism the compute thread's layer all-reduces
    and the comm stream's ZeRO collectives count at once."""

    def __init__(self) -> None:
        self._sent: Counter[str] = Counter()
        self._to: Counter[int] = Counter()
        self._lock = threading.Lock()

    def add(self, op: str, nbytes: int, *, peer: int | None = None) -> None:
        with self._lock:
            self._sent[op] += nbytes
            if peer is not None:
                self._to[peer] += nbytes

    def reset(self) -> None:
        with self._lock:
            self._sent.clear()
            self._to.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sent)

    def by_peer(self) -> dict[int, int]:
        with self._lock:
            return dict(self._to)


class Collective(Protocol):
    """A process group of ``world_size`` ranks as the partition owner uses it."""

    rank: int
    world_size: int
    counters: ByteCounters

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        """Sum ``buf`` across ranks into this rank's chunk (in place); return that chunk.
        The other chunks of ``buf`` are left holding partial sums. ``op`` names the bytes sent."""
        ...

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        """Fill every chunk of ``buf`` from its owner; this rank's chunk is the input."""
        ...

    def all_reduce_(self, buf: torch.Tensor) -> None:
        """Sum ``buf`` across ranks, in place, with identical bits on every rank."""
        ...

    def all_reduce_values(self, values: list[float]) -> list[float]:
        """Sum a few control scalars (norms, overflow flags) across ranks."""
        ...

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        """Point to point: send each ``(tensor, peer)`` and receive into each ``(tensor, peer)``,
        all at once, counting the bytes sent under ``op``. Messages between two ranks pair up
        in the order each side lists them."""
        ...

    def barrier(self) -> None: ...

    def destroy(self) -> None: ...

    def abort(self) -> None:
        """Tear down from another thread so that peers blocked on this rank fail promptly."""
        ...


Exchange = Callable[[torch.Tensor, torch.Tensor], None]  # send to the next rank, receive from the previous


def ring_reduce_scatter(parts: Sequence[torch.Tensor], rank: int, exchange: Exchange, tmp: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter of ``parts`` (one chunk per rank) in place: N - 1 exchanges, each
    rank adding what it receives into ``tmp``'s chunk; returns this rank's summed chunk."""
    n, r = len(parts), rank
    for k in range(n - 1):
        exchange(parts[(r - k - 1) % n], tmp)
        parts[(r - k - 2) % n].add_(tmp)
    return parts[r]


def ring_all_gather(parts: Sequence[torch.Tensor], rank: int, exchange: Exchange) -> None:
    """Ring all-gather of ``parts`` in place: N - 1 exchanges, each passing on a chunk."""
    n, r = len(parts), rank
    for k in range(n - 1):
        exchange(parts[(r - k) % n], parts[(r - k - 1) % n])


def chunks(buf: torch.Tensor, world_size: int) -> tuple[torch.Tensor, ...]:
    """The ``world_size`` equal chunks of a flat buffer (views)."""
    if buf.dim() != 1 or buf.numel() % world_size:
        raise ValueError(f"flat buffer of {buf.numel()} elements does not split into {world_size=} chunks")
    return buf.chunk(world_size)


class SoloGroup:
    """World size 1: every collective is the identity and sends nothing."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.counters = ByteCounters()

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        return buf

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        return None

    def all_reduce_(self, buf: torch.Tensor) -> None:
        return None

    def all_reduce_values(self, values: list[float]) -> list[float]:
        return list(values)

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        if sends or recvs:
            raise ValueError(f"{op}: a world of one rank has no peer to exchange {len(sends) + len(recvs)} messages with")

    def barrier(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    def abort(self) -> None:
        return None
